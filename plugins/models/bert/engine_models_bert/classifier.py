"""Cross-encoders: BERT and XLM-RoBERTa with a sequence-classification head, for the pooling
runner's ``classify`` task (``LLM.classify`` / ``LLM.score``, ``/classify``, ``/score``,
``/rerank``). The encoder is :mod:`engine_models_bert.model`'s; the engine pools CLS and
:meth:`classify` runs the checkpoint's head on it: BERT's pooler (dense + tanh) and
``classifier``, RoBERTa's ``classifier.dense`` + tanh and ``classifier.out_proj``. Module and
parameter names follow Hugging Face's ``*ForSequenceClassification`` so checkpoints load as
they are; dropout is an identity at inference.

A pair of texts is one prompt as the model's tokenizer builds it (BERT: ``[CLS] A [SEP] B
[SEP]``, RoBERTa: ``<s> A </s></s> B </s>``). BERT tells the two segments apart by token
type, which the engine's requests do not carry: :func:`pair_token_types` recovers it from
the prompt itself, as the tokenizer assigned it."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.interfaces import KVLayout, Model
from engine.layers import Layer, Linear, load_checkpoint
from engine_models_bert.model import QKV, BertEmbeddings, BertEncoder, encoder_kv_layout, encoder_reasons

TINY_ENCODER = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
)


def pair_token_types(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's token type [T] as a BERT tokenizer assigns it: 0 up to and including a
    prompt's first separator, 1 after it (``[CLS] A [SEP]`` is all 0; ``B [SEP]`` of a pair
    is 1). The separator is the prompt's last token (the tokenizer ends every input with
    it). The pooling runner computes each prompt whole in one step, so a prompt starts where
    its position is 0. A text that itself spells out the separator token differs from the
    tokenizer's types (the tokenizer knows which separator it added)."""
    starts = positions == 0
    starts[0] = True
    prompt = torch.cumsum(starts, 0) - 1  # each row's prompt, in step order
    start_rows = starts.nonzero().squeeze(1)
    end_rows = torch.cat([start_rows[1:], start_rows.new_tensor([len(input_ids)])]) - 1
    is_sep = (input_ids == input_ids[end_rows][prompt]).long()
    before = torch.cumsum(is_sep, 0) - is_sep  # separators before each row, over the whole step
    return (before - before[start_rows][prompt] > 0).long()


class BertPooler(Layer):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, [cfg.hidden_size], True, method, dtype)

    def forward(self, cls_hidden):
        return torch.tanh(self.dense(cls_hidden))


class BertBody(Layer):
    """``BertModel`` with its pooler layer, as a classifier's ``bert`` (or ``roberta``) module."""

    def __init__(self, cfg, method, dtype, position_offset: int = 0, pooler: bool = True):
        super().__init__()
        self.embeddings = BertEmbeddings(cfg, method, dtype, position_offset)
        self.encoder = BertEncoder(cfg, method, dtype)
        if pooler:
            self.pooler = BertPooler(cfg, method, dtype)

    def forward(self, input_ids, positions, step, token_types=None):
        return self.encoder(self.embeddings(input_ids, positions, token_types), step)


class EncoderClassifier(Model):
    """What both cross-encoders share: no LM head, CLS pooling, labels from the config."""

    generative = False
    default_pooling_type = "CLS"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.cfg = ctx.hf_config
        self.num_labels = ctx.hf_config.num_labels

    @classmethod
    def supports(cls, hf_config) -> list[str]:
        return encoder_reasons(hf_config)

    def kv_layout(self) -> KVLayout:
        return encoder_kv_layout(self.cfg)

    def compute_logits(self, hidden):
        raise NotImplementedError(f"{type(self).__name__} has no LM head: it classifies (runner='pooling')")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_checkpoint(
            self, weights, lambda name: None if name.endswith("position_ids") else name, fused=QKV
        )


class BertForSequenceClassification(EncoderClassifier):
    architectures = ("BertForSequenceClassification",)

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, method, dtype = ctx.hf_config, ctx.linear_method, ctx.dtype
        self.bert = BertBody(cfg, method, dtype)
        self.classifier = Linear(cfg.hidden_size, [cfg.num_labels], True, method, dtype)

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        return {
            "BertForSequenceClassification": dict(
                model_type="bert", **TINY_ENCODER, max_position_embeddings=128, num_labels=1
            )
        }

    def forward(self, input_ids, positions, step):
        types = pair_token_types(input_ids, positions) if self.cfg.type_vocab_size > 1 else None
        return self.bert(input_ids, positions, step, types)

    def classify(self, pooled):
        return self.classifier(self.bert.pooler(pooled))


class RobertaClassificationHead(Layer):
    def __init__(self, cfg, method, dtype):
        super().__init__()
        self.dense = Linear(cfg.hidden_size, [cfg.hidden_size], True, method, dtype)
        self.out_proj = Linear(cfg.hidden_size, [cfg.num_labels], True, method, dtype)

    def forward(self, cls_hidden):
        return self.out_proj(torch.tanh(self.dense(cls_hidden)))


class XLMRobertaForSequenceClassification(EncoderClassifier):
    """RoBERTa's encoder is BERT's; its positions start after the padding index (the engine
    counts ``max_model_len`` from there) and its one token type is 0."""

    architectures = ("XLMRobertaForSequenceClassification", "RobertaForSequenceClassification")

    def __init__(self, ctx):
        super().__init__(ctx)
        cfg, method, dtype = ctx.hf_config, ctx.linear_method, ctx.dtype
        self.roberta = BertBody(cfg, method, dtype, position_offset=cfg.pad_token_id + 1, pooler=False)
        self.classifier = RobertaClassificationHead(cfg, method, dtype)

    @classmethod
    def example_configs(cls) -> dict[str, dict]:
        tiny = dict(**TINY_ENCODER, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1)
        return {
            "XLMRobertaForSequenceClassification": dict(model_type="xlm-roberta", **tiny, num_labels=1),
            "RobertaForSequenceClassification": dict(model_type="roberta", **tiny, num_labels=3),
        }

    def forward(self, input_ids, positions, step):
        return self.roberta(input_ids, positions, step)

    def classify(self, pooled):
        return self.classifier(pooled)
