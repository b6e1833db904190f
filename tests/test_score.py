"""Scoring offline, against `transformers`: `LLM.score` 1:1, 1:N and N:N with a tiny BERT
cross-encoder whose pairs its real WordPiece tokenizer builds (`[CLS] A [SEP] B [SEP]`, token
types recovered by the model); the same model's `LLM.classify`, and a three-label one's
softmax; an embedding model's score
as the cosine of its CLS embeddings; a Qwen3 causal LM served as a yes/no reranker through
vLLM's `hf_overrides` recipe (the softmax of the last position's "no"/"yes" logits); and the
refusals, each a ValueError naming the field."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import LLM
from engine.messages.pooling_params import pooling_token_ids
from engine.testing import reference

QUERY = "what is the capital of france?"
DOCUMENTS = [
    "paris is the capital of france.",
    "the cat sat on the mat.",
    "berlin is the capital of germany, not france.",
]
WORDS = [
    *("what", "is", "the", "capital", "of", "france", "paris", "cat", "sat", "on", "mat"),
    *("berlin", "germany", "not", "a", "which", "city", "where", "are", "you"),
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_tokenizer(folder: str):
    """A real WordPiece tokenizer over a small vocabulary (the test texts' words, letters and
    punctuation), saved to ``folder``. Read back from its ``vocab.txt`` by ``from_pretrained``
    (transformers 5's constructor no longer reads ``vocab_file``: every word was ``[UNK]``)."""
    from transformers import BertTokenizerFast

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    vocab = SPECIALS + WORDS + letters + [f"##{c}" for c in letters] + list(".,?!'")
    with open(f"{folder}/vocab.txt", "w") as f:
        f.write("\n".join(dict.fromkeys(vocab)) + "\n")
    tokenizer = BertTokenizerFast.from_pretrained(folder)
    assert tokenizer.tokenize("paris") == ["paris"]
    tokenizer.save_pretrained(folder)
    return tokenizer


def bert_config(vocab_size: int, **extra) -> dict:
    return dict(
        model_type="bert",
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        **extra,
    )


def cross_encoder_checkpoint(folder: str, num_labels: int = 1, **extra):
    """(tokenizer, transformers model) of a tiny BERT cross-encoder saved to ``folder``."""
    tokenizer = bert_tokenizer(folder)
    config = bert_config(len(tokenizer), num_labels=num_labels, **extra)
    model = reference.tiny_checkpoint(
        folder, "BertForSequenceClassification", config, auto_class="AutoModelForSequenceClassification"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer, model


def hf_pair_scores(tokenizer, model, pairs) -> list[float]:
    with torch.no_grad():
        logits = [model(**tokenizer(a, b, return_tensors="pt")).logits[0, 0] for a, b in pairs]
    return [torch.sigmoid(logit).item() for logit in logits]


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("cross-encoder"))
    tokenizer, model = cross_encoder_checkpoint(folder)
    return LLM(folder, dtype="float32", device="cpu", num_blocks=32, block_size=16), tokenizer, model


def test_cross_encoder_scores_match_transformers(cross_encoder):
    """1:N, N:N and 1:1; the pair is one input with its segments' token types (a pair whose
    types were all 0 would score otherwise: the parity checks the types too)."""
    llm, tokenizer, model = cross_encoder
    one_to_n = llm.score(QUERY, DOCUMENTS)
    expected = hf_pair_scores(tokenizer, model, [(QUERY, d) for d in DOCUMENTS])
    assert [o.outputs.score for o in one_to_n] == pytest.approx(expected, abs=1e-5)
    assert one_to_n[0].prompt_token_ids == tokenizer(QUERY, DOCUMENTS[0])["input_ids"]
    firsts = ["which city is in germany?", "where are you?", QUERY]
    n_to_n = llm.score(firsts, DOCUMENTS)
    assert [o.outputs.score for o in n_to_n] == pytest.approx(
        hf_pair_scores(tokenizer, model, list(zip(firsts, DOCUMENTS))), abs=1e-5
    )
    [single] = llm.score(QUERY, DOCUMENTS[1])
    assert single.outputs.score == pytest.approx(expected[1], abs=1e-5)


def test_cross_encoder_classifies_and_refuses(cross_encoder):
    llm, tokenizer, model = cross_encoder
    [out] = llm.classify(DOCUMENTS[0])
    with torch.no_grad():
        logit = model(**tokenizer(DOCUMENTS[0], return_tensors="pt")).logits[0, 0]
    assert out.outputs.num_classes == 1
    assert out.outputs.probs == pytest.approx([torch.sigmoid(logit).item()], abs=1e-5)
    with pytest.raises(ValueError, match="text_2"):
        llm.score(["a", "b"], ["a", "b", "c"])
    with pytest.raises(ValueError, match="text_2"):
        llm.score(QUERY, [])
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate("paris")  # a classifier generates nothing


LONG_DOCUMENT = " ".join(["paris"] * 80)  # 80 tokens: more than the model's 64 positions


def hf_probs(model, encoded) -> list[float]:
    """transformers' sigmoid of a one-label model's logit on ``encoded`` (a tokenizer's output
    for one input, or ``{"input_ids": ids}``)."""
    with torch.no_grad():
        logit = model(**{key: torch.tensor([value]) for key, value in encoded.items()}).logits[0, 0]
    return [torch.sigmoid(logit).item()]


def test_truncate_prompt_tokens_keeps_each_inputs_first_tokens(cross_encoder):
    """vLLM's pooling truncation: a pair as the tokenizer truncates it (the longer text first,
    [CLS]/[SEP] kept), a text likewise, token ids cut to their first k; -1 is the context
    (64 here); each score equals transformers on the truncated input."""
    llm, tokenizer, model = cross_encoder
    for keep, length in ((20, 20), (-1, 64)):
        [out] = llm.score(QUERY, LONG_DOCUMENT, truncate_prompt_tokens=keep)
        encoded = tokenizer(QUERY, LONG_DOCUMENT, truncation=True, max_length=length)
        assert out.prompt_token_ids == encoded["input_ids"] and len(out.prompt_token_ids) == length
        assert out.prompt_token_ids[: len(tokenizer(QUERY)["input_ids"])] == tokenizer(QUERY)["input_ids"]
        assert [out.outputs.score] == pytest.approx(hf_probs(model, encoded), abs=1e-5)
    [text] = llm.classify(LONG_DOCUMENT, truncate_prompt_tokens=10)
    encoded = tokenizer(LONG_DOCUMENT, truncation=True, max_length=10)
    assert (
        text.prompt_token_ids == encoded["input_ids"] and text.prompt_token_ids[-1] == tokenizer.sep_token_id
    )
    assert text.outputs.probs == pytest.approx(hf_probs(model, encoded), abs=1e-5)
    ids = tokenizer(DOCUMENTS[2])["input_ids"]
    [cut] = llm.classify([ids], truncate_prompt_tokens=5)
    assert cut.prompt_token_ids == ids[:5]
    assert cut.outputs.probs == pytest.approx(hf_probs(model, {"input_ids": ids[:5]}), abs=1e-5)
    for bad in (65, 0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.score(QUERY, DOCUMENTS, truncate_prompt_tokens=bad)
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            llm.classify(DOCUMENTS, truncate_prompt_tokens=bad)


def test_truncation_leaves_the_shared_tokenizer_alone(tmp_path):
    """A truncating call must not cut another thread's untruncated one: transformers' fast
    tokenizers keep truncation as state, so the cut runs on a private right-truncating copy
    (right even where the tokenizer is configured to cut on the left, as vLLM's pooling runner)."""
    tokenizer = bert_tokenizer(str(tmp_path))
    tokenizer.truncation_side = "left"
    full = tokenizer(LONG_DOCUMENT)["input_ids"]
    cut = full[:4] + [tokenizer.sep_token_id]
    stop = threading.Event()

    def truncate():
        while not stop.is_set():
            assert pooling_token_ids(tokenizer, LONG_DOCUMENT, keep=5) == cut

    thread = threading.Thread(target=truncate)
    thread.start()
    try:
        lengths = {len(tokenizer(LONG_DOCUMENT)["input_ids"]) for _ in range(300)}
    finally:
        stop.set()
        thread.join()
    assert lengths == {len(full)}
    assert tokenizer(LONG_DOCUMENT, truncation=True, max_length=5)["input_ids"] == full[:1] + full[-4:]


def test_three_label_classifier_gives_softmax_and_no_score(tmp_path):
    """A classifier of several labels: `classify` is a softmax over them (vs transformers);
    it has no single relevance score, so `score` refuses it, as vLLM does."""
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    tokenizer, model = cross_encoder_checkpoint(str(tmp_path), num_labels=3, id2label=labels)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", num_blocks=32, block_size=16)
    assert llm.engine.classifier_labels == list(labels.values())
    outs = llm.classify(DOCUMENTS)
    for text, out in zip(DOCUMENTS, outs):
        with torch.no_grad():
            expected = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], dim=-1)
        assert out.outputs.probs == pytest.approx(expected.tolist(), abs=1e-5)
    with pytest.raises(ValueError, match="3 labels"):
        llm.score(QUERY, DOCUMENTS)


def test_embedding_model_scores_by_cosine(tmp_path):
    folder = str(tmp_path)
    tokenizer = bert_tokenizer(folder)
    config = bert_config(len(tokenizer))
    model = reference.tiny_checkpoint(folder, "BertModel", config, auto_class="AutoModel")
    tokenizer.save_pretrained(folder)
    llm = LLM(folder, dtype="float32", device="cpu", num_blocks=32, block_size=16)
    outs = llm.score(QUERY, DOCUMENTS)
    query = reference.hf_pooled(model, tokenizer(QUERY)["input_ids"], "CLS", True)
    for doc, out in zip(DOCUMENTS, outs):
        expected = query @ reference.hf_pooled(model, tokenizer(doc)["input_ids"], "CLS", True)
        assert out.outputs.score == pytest.approx(expected.item(), abs=1e-5)
    cut = [tokenizer(text, truncation=True, max_length=4)["input_ids"] for text in (QUERY, *DOCUMENTS)]
    query = reference.hf_pooled(model, cut[0], "CLS", True)
    for ids, out in zip(cut[1:], llm.score(QUERY, DOCUMENTS, truncate_prompt_tokens=4)):
        assert out.prompt_token_ids == cut[0] + ids  # each text its first 4 tokens, [SEP] kept
        expected = query @ reference.hf_pooled(model, ids, "CLS", True)
        assert out.outputs.score == pytest.approx(expected.item(), abs=1e-5)
    with pytest.raises(ValueError, match="task"):
        llm.classify(QUERY)  # no classification head


RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def test_qwen3_reranker_scores_yes_against_no(tmp_path, default_tokenizer):
    """The score is the softmax of the last position's "yes" logit against "no", as the Qwen3
    reranker's own recipe computes it with transformers."""
    folder = str(tmp_path)
    config = dict(
        model_type="qwen3",
        vocab_size=len(default_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = reference.tiny_checkpoint(folder, "Qwen3ForCausalLM", config, tokenizer=default_tokenizer)
    llm = LLM(folder, dtype="float32", device="cpu", num_blocks=32, hf_overrides=RERANKER_OVERRIDES)
    no, yes = default_tokenizer.convert_tokens_to_ids(["no", "yes"])
    outs = llm.score(QUERY, DOCUMENTS)
    for doc, out in zip(DOCUMENTS, outs):
        ids = default_tokenizer(QUERY, doc)["input_ids"]
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            last = model(torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(last[[no, yes]], dim=-1)[1].item()
        assert out.outputs.score == pytest.approx(expected, abs=1e-5)
    with pytest.raises(ValueError, match="classifier_from_token"):
        unknown = {**RERANKER_OVERRIDES, "classifier_from_token": ["no", "\x00zz"]}
        LLM(folder, dtype="float32", device="cpu", hf_overrides=unknown)


def test_generation_model_refuses_to_score(tiny_llm):
    with pytest.raises(ValueError, match="pooling_params"):
        tiny_llm.score("a", "b")
