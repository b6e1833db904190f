"""The API process's edge without an engine: depth and schema checks, the prefix-cache
window, and what a 500 tells the client (a request id) against what the log gets."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient

from engine.messages.stats import EngineStats
from engine_server.app import ServerState, build_app
from engine_server.errors import APIError
from engine_server.prefix_window import PrefixCacheWindow
from engine_server.schemas import CompletionRequest
from engine_server.validation import check_depth, check_json_schema, decode_body


def test_depth_limit_names_the_field_and_survives_any_depth():
    check_depth([[1]] * 3, "prompt", limit=2)
    with pytest.raises(APIError, match="prompt nests JSON deeper") as error:
        check_depth([[[1]]], "prompt", limit=2)
    assert error.value.param == "prompt"
    deep: list = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    with pytest.raises(APIError):
        check_depth(deep, "prompt")
    with pytest.raises(APIError, match="deeper than 64") as error:
        decode_body(b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", CompletionRequest)
    with pytest.raises(APIError) as error:
        decode_body(
            b'{"prompt": "x", "guided_json": ' + b'{"a": ' * 70 + b"1" + b"}" * 70 + b"}", CompletionRequest
        )
    assert error.value.param == "guided_json"


def test_schema_checked_against_its_meta_schema():
    assert check_json_schema({"type": "object", "properties": {"a": {"pattern": r"\p{L}+"}}}, "p")
    for bad, text in [
        ({"type": "nope"}, "invalid json schema in p['type']"),
        ("x", "must be a JSON schema object"),
        ({"$schema": 5}, "$schema must be a string"),
        ({"properties": {"a": {"minimum": "zero"}}}, "['properties']['a']['minimum']"),
    ]:
        with pytest.raises(APIError) as error:
            check_json_schema(bad, "p")
        assert text in error.value.message and error.value.status == 400


def test_integers_past_64_bits_are_400s_naming_the_field():
    for field in ("seed", "top_k", "priority", "min_tokens"):
        with pytest.raises(APIError) as error:
            decode_body(f'{{"prompt": "x", "{field}": {2**70}}}'.encode(), CompletionRequest)
        assert error.value.param == field
    with pytest.raises(APIError) as error:
        decode_body(f'{{"prompt": "x", "stop_token_ids": [1, {2**64}]}}'.encode(), CompletionRequest)
    assert error.value.param == "stop_token_ids"


def test_prefix_counters_move_once_a_window():
    seen, clock = [], [0.0]
    window = PrefixCacheWindow(seen.append, window=30.0, clock=lambda: clock[0])
    window(EngineStats(running=1, prefix_queries=10, prefix_hits=8))
    clock[0] = 29.0
    window(EngineStats(running=2, prefix_queries=20, prefix_hits=9))
    assert [s.prefix_hits for s in seen] == [0, 0] and seen[-1].running == 2
    clock[0] = 30.5
    window(EngineStats(running=0, prefix_queries=30, prefix_hits=12))
    clock[0] = 31.0
    window(EngineStats(running=0, prefix_queries=40, prefix_hits=20))
    assert [(s.prefix_queries, s.prefix_hits) for s in seen[2:]] == [(30, 12), (30, 12)]


class _FailingTokenizer:
    """Raises the way a bug deep in a tokenizer would, with a detail the client must not see."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        raise RuntimeError("cannot read /srv/secret/model/tokenizer.json")


class _Client:
    dead = None


def test_500_body_is_a_request_id_and_the_log_has_the_details(caplog):
    state = ServerState(_Client(), _FailingTokenizer(), "m", 64, 100, metrics=None, api_keys=("k",))
    with (
        TestClient(build_app(state), raise_server_exceptions=False) as http,
        caplog.at_level(logging.ERROR, logger="engine_server"),
    ):
        response = http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"})
        refused = http.post("/tokenize", json={"prompt": "hi"})
        plain = http.post(
            "/tokenize",
            content=b'{"prompt": "hi"}',
            headers={"Authorization": "Bearer k", "Content-Type": "text/plain"},
        )
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["message"].startswith("internal error (request id err-") and "secret" not in response.text
    request_id = error["message"].split("request id ")[1].rstrip(")")
    assert request_id in caplog.text and "RuntimeError" in caplog.text and "/srv/secret" in caplog.text
    assert refused.status_code == 401 and plain.status_code == 415


def test_unknown_fields_are_refused_unless_allowed():
    body = b'{"prompt": "x", "logit_bias_typo": {"1": 2}, "suffix": null}'
    with pytest.raises(APIError, match="unsupported field logit_bias_typo") as error:
        decode_body(body, CompletionRequest)
    assert error.value.param == "logit_bias_typo" and error.value.status == 400
    assert decode_body(body, CompletionRequest, allow_unknown=True).prompt == "x"
    assert decode_body(b'{"prompt": "x", "suffix": null}', CompletionRequest).prompt == "x"  # null: not set
