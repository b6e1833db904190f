"""`/score`, `/rerank` and `/classify` on a real `engine serve` with a tiny BERT cross-encoder
(its real WordPiece tokenizer builds the pairs), over HTTP: every route spelling and request
shape vLLM takes, scores and probabilities against `transformers`, the rerank order and
`top_n` / `return_documents`; bad input gets an OpenAI-shaped 400 naming the field and leaves
the server serving. (The routes on a generating server: tests/test_fuzz_server.py.)"""

from __future__ import annotations

import pytest
import torch

from tests.serving import serve
from tests.test_score import (
    DOCUMENTS,
    LONG_DOCUMENT,
    QUERY,
    cross_encoder_checkpoint,
    hf_pair_scores,
    hf_probs,
)

SERVE_ARGS = ("--dtype", "float32", "--device", "cpu", "--num-blocks", "32", "--block-size", "16")
LABEL = "relevant"


@pytest.fixture(scope="module")
def scoring(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("cross-encoder-server"))
    tokenizer, model = cross_encoder_checkpoint(folder, id2label={0: LABEL}, label2id={LABEL: 0})
    with serve(folder, *SERVE_ARGS) as server, server.http() as http:
        yield http, tokenizer, model


def post(http, path: str, body: dict) -> dict:
    response = http.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_score_routes_and_spellings_match_transformers(scoring):
    http, tokenizer, model = scoring
    firsts = ["which city is in germany?", "where are you?", QUERY]
    shapes = [
        ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}, [(QUERY, d) for d in DOCUMENTS]),
        ("/v1/score", {"queries": firsts, "documents": DOCUMENTS}, list(zip(firsts, DOCUMENTS))),
        ("/v1/score", {"data_1": QUERY, "data_2": DOCUMENTS[1]}, [(QUERY, DOCUMENTS[1])]),
    ]
    for path, body, pairs in shapes:
        out = post(http, path, body)
        assert out["object"] == "list" and out["id"].startswith("score-")
        assert [d["index"] for d in out["data"]] == list(range(len(pairs)))
        assert {d["object"] for d in out["data"]} == {"score"}
        assert [d["score"] for d in out["data"]] == pytest.approx(
            hf_pair_scores(tokenizer, model, pairs), abs=1e-5
        )
        tokens = sum(len(tokenizer(a, b)["input_ids"]) for a, b in pairs)
        assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == tokens


def test_rerank_orders_documents_by_relevance(scoring):
    http, tokenizer, model = scoring
    expected = hf_pair_scores(tokenizer, model, [(QUERY, d) for d in DOCUMENTS])
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]]  # strings and {text} objects
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        out = post(http, path, {"query": QUERY, "documents": documents})
        assert [r["index"] for r in out["results"]] == order
        assert [r["relevance_score"] for r in out["results"]] == pytest.approx(
            [expected[i] for i in order], abs=1e-5
        )
        assert [r["document"]["text"] for r in out["results"]] == [DOCUMENTS[i] for i in order]
        assert out["usage"]["total_tokens"] > 0
    top = post(
        http, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}
    )
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all("document" not in r for r in top["results"])


def test_classify_gives_label_and_probs(scoring):
    http, tokenizer, model = scoring
    for path, body, texts in [
        ("/classify", {"input": DOCUMENTS[0]}, DOCUMENTS[:1]),
        ("/v1/classify", {"input": DOCUMENTS}, DOCUMENTS),
    ]:
        out = post(http, path, body)
        with torch.no_grad():
            logits = [model(**tokenizer(text, return_tensors="pt")).logits[0, 0] for text in texts]
        assert out["object"] == "list"
        for i, (entry, logit) in enumerate(zip(out["data"], logits)):
            assert entry["index"] == i and entry["label"] == LABEL and entry["num_classes"] == 1
            assert entry["probs"] == pytest.approx([torch.sigmoid(logit).item()], abs=1e-5)


def test_truncate_prompt_tokens_on_every_pooling_route(scoring):
    """Each input's first k tokens (-1: the context), as vLLM's pooling runner cuts them:
    a pair as the tokenizer truncates it, token ids as given; scores against transformers on
    the truncated input, usage counting what was scored."""
    http, tokenizer, model = scoring
    pair = tokenizer(QUERY, LONG_DOCUMENT, truncation=True, max_length=20)
    expected = hf_probs(model, pair)
    for path, body in [
        ("/score", {"text_1": QUERY, "text_2": LONG_DOCUMENT}),
        ("/v1/score", {"queries": [QUERY], "documents": [LONG_DOCUMENT]}),
    ]:
        out = post(http, path, {**body, "truncate_prompt_tokens": 20})
        assert [d["score"] for d in out["data"]] == pytest.approx(expected, abs=1e-5)
        assert out["usage"]["prompt_tokens"] == 20
    context = tokenizer(QUERY, LONG_DOCUMENT, truncation=True, max_length=64)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": QUERY, "documents": [LONG_DOCUMENT, DOCUMENTS[0]], "truncate_prompt_tokens": -1}
        out = post(http, path, body)
        by_index = {r["index"]: r["relevance_score"] for r in out["results"]}
        assert [by_index[0]] == pytest.approx(hf_probs(model, context), abs=1e-5)
        assert [by_index[1]] == pytest.approx(
            hf_pair_scores(tokenizer, model, [(QUERY, DOCUMENTS[0])]), abs=1e-5
        )
    ids = tokenizer(DOCUMENTS[2])["input_ids"]
    text = tokenizer(LONG_DOCUMENT, truncation=True, max_length=10)
    for path in ("/classify", "/v1/classify"):
        out = post(http, path, {"input": [ids], "truncate_prompt_tokens": 5})
        assert out["data"][0]["probs"] == pytest.approx(hf_probs(model, {"input_ids": ids[:5]}), abs=1e-5)
        assert out["usage"]["prompt_tokens"] == 5
        out = post(http, path, {"input": LONG_DOCUMENT, "truncate_prompt_tokens": 10})
        assert out["data"][0]["probs"] == pytest.approx(hf_probs(model, text), abs=1e-5)


LONG = " ".join(["paris"] * 80)  # more tokens than the model's 64 positions


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/score", {"text_1": QUERY}, "text_2"),
        ("/score", {"input": QUERY}, "input"),  # an unknown field
        ("/v1/score", {"text_1": "a", "text_2": "b", "queries": "a", "documents": "b"}, "text_1"),
        ("/v1/score", {"queries": QUERY, "documents": [LONG]}, "documents"),
        ("/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/rerank", {"query": QUERY, "documents": [""]}, "documents"),
        ("/rerank", {"query": QUERY, "documents": [3]}, "documents"),
        ("/rerank", {"query": QUERY, "documents": ["a"], "top_n": -1}, "top_n"),
        ("/rerank", {"documents": ["a"]}, "query"),
        ("/classify", {"input": LONG}, "input"),
        ("/classify", {"input": []}, "input"),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        (
            "/rerank",
            {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
        ),
        ("/classify", {"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ("/v1/classify", {"input": "a", "truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "model"),  # a classifier generates nothing
    ],
)
def test_bad_input_is_a_400_naming_the_field(scoring, path, body, param):
    http, _, _ = scoring
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert post(http, "/score", {"text_1": "a", "text_2": "b"})["data"][0]["score"] > 0  # still serving
