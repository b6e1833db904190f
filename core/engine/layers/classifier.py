"""A decoder served as a sequence classifier: Hugging Face's ``*ForSequenceClassification``
(the last token's hidden state through a ``score`` projection, no LM head) and vLLM's recipe
for a causal LM that answers with a token — the original Qwen3 reranker, served with
``--hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token":
["no", "yes"], "is_original_qwen3_reranker": true}'``: the LM head's logits of those tokens at
the last position make the classifier. Two tokens are a (negative, positive) pair and make one
label whose logit is their difference, so its sigmoid is the softmax of the two tokens'
logits, the positive's probability (the Qwen3 reranker's score); any other number of tokens
makes one label per token, its logit."""

from __future__ import annotations

import torch

from engine.layers.linear import Linear


class DecoderSequenceClassifier:
    """Mixed in before a :class:`engine.layers.DecoderForCausalLM` family:
    ``class Qwen3ForSequenceClassification(DecoderSequenceClassifier, Qwen3ForCausalLM)``."""

    generative = False
    default_pooling_type = "LAST"  # the token a causal decoder has seen the whole prompt by

    def __init__(self, ctx):
        super().__init__(ctx)  # type: ignore[call-arg]
        cfg = ctx.hf_config
        self.label_tokens = list(getattr(cfg, "classifier_from_token_ids", None) or [])
        if self.label_tokens:
            self.num_labels = 1 if len(self.label_tokens) == 2 else len(self.label_tokens)
            return
        self.num_labels = cfg.num_labels
        if hasattr(self, "lm_head"):  # a classification checkpoint has a score head instead
            del self.lm_head
        self.score = Linear(cfg.hidden_size, [cfg.num_labels], False, ctx.linear_method, ctx.dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        if not self.label_tokens:
            return self.score(pooled)
        logits = self.compute_logits(pooled)[:, self.label_tokens]  # type: ignore[attr-defined]
        if len(self.label_tokens) == 2:
            return (logits[:, 1] - logits[:, 0]).unsqueeze(-1)
        return logits
