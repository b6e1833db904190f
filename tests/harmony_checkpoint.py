"""A tiny gpt-oss checkpoint that speaks harmony: gpt-oss's real tokenizer (the o200k
vocabulary with harmony's special tokens at their ids, as a ``tokenizers`` BPE whose merges are
derived from the ranks) and a ``GptOssForCausalLM`` saved with ``transformers`` whose weights
make it, by construction, a bigram model following a given chain of tokens: attention and
experts write nothing to the residual stream, so the hidden state at each position is the
token's embedding, a one-hot that the LM head maps to the next token of the chain."""

from __future__ import annotations

import base64
import itertools
import json
import os

from engine.entrypoints.harmony import O200K_FILE, encoding, offline_vocab_dir

PATTERN = (  # o200k's pre-tokenizer
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB_SIZE = 201088  # gpt-oss's embedding rows: o200k, harmony's special tokens, padding
LAST_SPECIAL = 200018  # <|endofprompt|>: gpt-oss's tokenizer names no reserved token past it


def _byte_chars() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (what byte-level BPE vocabularies hold)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Each multi-byte token's last merge: BPE over its bytes with the lower ranks only."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        parts = [token[i : i + 1] for i in range(len(token))]
        pairs = [ranks.get(a + b, rank) for a, b in itertools.pairwise(parts)]
        while len(parts) > 2 and (best := min(pairs)) < rank:
            at = pairs.index(best)  # the lowest rank, leftmost first, as tiktoken merges
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
            del pairs[at]
            if at > 0:
                pairs[at - 1] = ranks.get(parts[at - 1] + parts[at], rank)
            if at < len(pairs):
                pairs[at] = ranks.get(parts[at] + parts[at + 1], rank)
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


def save_o200k_tokenizer(folder: str) -> None:
    """tokenizer.json and tokenizer_config.json for gpt-oss's vocabulary in ``folder``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    ranks = {}
    with open(os.path.join(offline_vocab_dir(), O200K_FILE), "rb") as f:
        for line in f:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    chars = _byte_chars()
    text = {token: "".join(chars[b] for b in token) for token in ranks}
    model = models.BPE(
        {text[t]: r for t, r in ranks.items()}, [(text[a], text[b]) for a, b in _merges(ranks)]
    )
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    harmony = encoding()
    ids = {t: harmony.encode(t, allowed_special="all")[0] for t in harmony.special_tokens_set}
    ids = {t: i for t, i in ids.items() if i <= LAST_SPECIAL}
    specials = sorted(ids, key=ids.get)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.add_special_tokens({"additional_special_tokens": specials})
    assert all(fast.convert_tokens_to_ids(t) == i for t, i in ids.items()), "harmony's ids"
    fast.eos_token, fast.pad_token = "<|return|>", "<|endoftext|>"
    fast.save_pretrained(folder)


def save_bigram_gpt_oss(folder: str, chain: list[int], hidden_size: int = 32) -> None:
    """A float32 ``GptOssForCausalLM`` (one layer) in ``folder`` whose greedy next token after
    ``chain[i]`` is ``chain[i + 1]``; every token of the chain must be distinct."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    assert len(set(chain)) == len(chain) <= hidden_size
    config = GptOssConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=32,
        head_dim=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=16,
        layer_types=["full_attention"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=199999,  # <|endoftext|> only: the server's harmony stop tokens end the turn
        pad_token_id=199999,
    )
    torch.manual_seed(0)
    model = GptOssForCausalLM(config).float()
    with torch.no_grad():
        layer = model.model.layers[0]
        for tensor in (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias):
            tensor.zero_()  # attention adds nothing
        for name, tensor in layer.mlp.experts.named_parameters():
            if name.startswith("down_proj"):
                tensor.zero_()  # nor do the experts
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.normal_(0, 0.01)
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        for i, token in enumerate(chain):
            embed[token].zero_()
            embed[token, i] = 1.0
            if i + 1 < len(chain):
                head[chain[i + 1], i] = 10.0
    model.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["model_type"] == "gpt_oss"
