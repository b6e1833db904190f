"""`/v1/embeddings` on a real `engine serve`, spoken to with the official `openai` client:
a tiny random BERT pooled CLS (its default) and MEAN (`--pooler-config`), and a tiny Llama
pooled LAST (`--runner pooling`), each matching `transformers` (cosine >= 0.9999, float32)
normalised and not, for every input shape and both encodings; bad input gets an
OpenAI-shaped 400 naming the field and leaves the server serving."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
import torch

from engine.testing import reference
from tests.conftest import TINY_LLAMA
from tests.serving import serve

pytestmark = pytest.mark.slow

TINY_BERT = dict(
    model_type="bert",
    vocab_size=TINY_LLAMA["vocab_size"],
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    matryoshka_dimensions=[16, 32],
)
SERVE_ARGS = ("--dtype", "float32", "--num-blocks", "64", "--block-size", "16")
TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog, twice.",
    "a b c d e f g h i j k l m n o p",
    "Why?",
]
# name -> (checkpoint fixture, pooling type, extra flags)
SERVERS = {
    "bert-cls": ("tiny_bert", "CLS", ()),
    "bert-mean": ("tiny_bert", "MEAN", ("--pooler-config", '{"pooling_type": "MEAN"}')),
    "llama-last": ("tiny_llama", "LAST", ("--runner", "pooling")),
}


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, default_tokenizer):
    folder = str(tmp_path_factory.mktemp("tiny-bert"))
    return folder, reference.tiny_checkpoint(
        folder, "BertModel", TINY_BERT, tokenizer=default_tokenizer, auto_class="AutoModel"
    )


@pytest.fixture(scope="module", params=sorted(SERVERS))
def embedding_server(request):
    checkpoint, pooling_type, flags = SERVERS[request.param]
    folder, hf_model = request.getfixturevalue(checkpoint)
    with serve(folder, *SERVE_ARGS, *flags) as server:
        yield server, hf_model, pooling_type


def test_embeddings_match_transformers(embedding_server, default_tokenizer):
    server, hf_model, pooling_type = embedding_server
    client, model = server.openai(), server.model()
    ids = [default_tokenizer.encode(text) for text in TEXTS]
    # the client asks for base64 unless told otherwise, and decodes it itself
    for normalize, extra in ((True, None), (False, {"normalize": False})):
        for encoding in (openai.NOT_GIVEN, "float"):
            response = client.embeddings.create(
                model=model, input=TEXTS, encoding_format=encoding, extra_body=extra
            )
            assert [d.index for d in response.data] == list(range(len(TEXTS)))
            assert all(d.object == "embedding" for d in response.data) and response.object == "list"
            assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
            for d, prompt in zip(response.data, ids):
                reference.assert_pooled_matches(d.embedding, hf_model, prompt, pooling_type, normalize)
    one = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    reference.assert_pooled_matches(one.data[0].embedding, hf_model, ids[1], pooling_type, True)
    for given, prompts in ((ids[2], [ids[2]]), (ids, ids)):  # token ids, and a list of such lists
        response = client.embeddings.create(model=model, input=given, encoding_format="float")
        for d, prompt in zip(response.data, prompts, strict=True):
            reference.assert_pooled_matches(d.embedding, hf_model, prompt, pooling_type, True)


def test_base64_is_little_endian_float32_and_requests_are_counted(embedding_server):
    server, _, _ = embedding_server
    before = server.metric("vllm:request_success_total"), server.metric("vllm:prompt_tokens_total")
    with server.http() as http:
        body = {"model": server.model(), "input": [[5, 6, 7], [8, 9]]}
        floats = http.post("/v1/embeddings", json={**body, "encoding_format": "float"}).json()["data"]
        encoded = http.post("/v1/embeddings", json={**body, "encoding_format": "base64"}).json()["data"]
    for f, e in zip(floats, encoded, strict=True):
        decoded = np.frombuffer(base64.b64decode(e["embedding"]), dtype="<f4")
        assert decoded.tolist() == f["embedding"]
    assert server.metric("vllm:request_success_total") == before[0] + 4  # two inputs, twice
    assert server.metric("vllm:prompt_tokens_total") == before[1] + 10


BAD = [
    ({"input": []}, "input"),
    ({"input": ""}, "input"),  # no tokens
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [TINY_LLAMA["vocab_size"]]}, "input"),  # a token id outside the vocabulary
    ({"input": list(range(3, 3 + 129))}, "input"),  # longer than max_model_len (128)
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),  # not one of the model's matryoshka dimensions
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "dimensions": 65}, "dimensions"),  # over the hidden size
    ({"input": "hi", "normalize": "yes"}, "normalize"),
    ({"input": "hi", "temperature": 0.5}, "temperature"),  # not an embeddings field
    ({"input": "hi", "truncate_prompt_tokens": 129}, "truncate_prompt_tokens"),  # over the context
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
]


@pytest.fixture(scope="module")
def bert_server(tiny_bert):
    with serve(tiny_bert[0], *SERVE_ARGS) as server:
        yield server


@pytest.mark.parametrize("body, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_input_is_a_400_naming_the_field(bert_server, body, param):
    with bert_server.http() as http:
        response = http.post("/v1/embeddings", json={"model": bert_server.model(), **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert len(http.post("/v1/embeddings", json={"input": "still serving"}).json()["data"]) == 1


def test_matryoshka_dimensions(bert_server, tiny_bert, default_tokenizer):
    client = bert_server.openai()
    response = client.embeddings.create(model=bert_server.model(), input=TEXTS[1], dimensions=16)
    [vector] = [d.embedding for d in response.data]
    full = reference.hf_pooled(tiny_bert[1], default_tokenizer.encode(TEXTS[1]), "CLS", normalize=False)
    expected = torch.nn.functional.normalize(full[:16], dim=-1)  # cut first, then normalised
    torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-4, rtol=1e-4)


def test_truncate_prompt_tokens_embeds_the_first_tokens(bert_server, tiny_bert, default_tokenizer):
    """vLLM's pooling truncation: a text as the tokenizer truncates it on the right, token ids
    as given; -1 is the context (128), which makes an over-long input fit."""
    client, model = bert_server.openai(), bert_server.model()
    ids = default_tokenizer.encode(TEXTS[1])
    long = list(range(3, 3 + 200))
    for given, keep, scored in ((TEXTS[1], 4, ids[:4]), ([ids], 3, ids[:3]), ([long], -1, long[:128])):
        response = client.embeddings.create(
            model=model, input=given, encoding_format="float", extra_body={"truncate_prompt_tokens": keep}
        )
        assert response.usage.prompt_tokens == len(scored)
        reference.assert_pooled_matches(response.data[0].embedding, tiny_bert[1], scored, "CLS", True)


def test_generation_routes_refuse_a_pooling_server(bert_server):
    client = bert_server.openai()
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.completions.create(model=bert_server.model(), prompt="Hello", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        client.chat.completions.create(
            model=bert_server.model(), messages=[{"role": "user", "content": "Hi"}]
        )
    with bert_server.http() as http:
        schema = http.get("/openapi.json").json()
    assert "/v1/embeddings" in schema["paths"] and "EmbeddingRequest" in schema["components"]["schemas"]
