"""Reference models from ``transformers`` for parity checks: tiny random checkpoints written
as real safetensors folders, and greedy generation one prompt at a time (no padding)."""

from __future__ import annotations

import os

import torch


def tiny_checkpoint(
    folder: str,
    architecture: str,
    config_kwargs: dict,
    seed: int = 0,
    tokenizer=None,
    auto_class: str = "AutoModelForCausalLM",
):
    """Build a random ``transformers`` model, save it (config.json + safetensors) to
    ``folder`` and return it. Weights are drawn wider than the default init so logits are
    peaked and greedy choices are not decided by rounding noise. ``auto_class`` builds it
    (``AutoModel`` for an encoder without an LM head, such as ``BertModel``)."""
    import transformers
    from transformers import AutoConfig

    kwargs = dict(config_kwargs)
    model_type = kwargs.pop("model_type")
    kwargs.setdefault("initializer_range", 0.25)
    config = AutoConfig.for_model(model_type, architectures=[architecture], **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, auto_class).from_config(config, dtype=torch.float32).eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return model


def randomize_norms(model, folder: str, seed: int = 0, also: tuple[str, ...] = ()) -> None:
    """Draw ``model``'s norm weights (1-D parameters whose name ends in ``norm.weight``) around
    their init and save it to ``folder`` again: ``transformers`` initialises them to ones (or
    zeros, for a ``(1 + w)`` norm), which a model that drops, swaps or misreads one matches.
    Parameters and buffers whose name ends in one of ``also`` are moved the same way (a router's
    bias ``transformers`` initialises to zeros, say)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in [*model.named_parameters(), *model.named_buffers()]:
            if (name.endswith("norm.weight") and param.dim() == 1) or name.endswith(also):
                param.add_(torch.rand(param.shape, generator=gen) * 0.5 - 0.25)
    model.save_pretrained(folder, safe_serialization=True)


def hf_from_loader(loader, dtype=torch.float32):
    """The same weights our loader yields, in a ``transformers`` model."""
    from transformers import AutoModelForCausalLM

    config = loader.hf_config()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    state = dict(loader.iter_weights(config))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    model.tie_weights()
    return model


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of each prompt, ignoring EOS, one prompt at a time."""
    out = []
    for ids in prompts:
        generated = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pad_token_id=0,
        )
        out.append(generated[0, len(ids) :].tolist())
    return out


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits at every position: [len(ids), vocab]."""
    return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


@torch.inference_mode()
def hf_pooled(model, ids: list[int], pooling_type: str, normalize: bool) -> torch.Tensor:
    """One prompt's embedding from ``transformers``: the base model's last hidden state (after
    the final norm of a decoder) pooled LAST / CLS / MEAN, L2-normalised if asked: [hidden]."""
    hidden = model.base_model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"LAST": hidden[-1], "CLS": hidden[0], "MEAN": hidden.mean(dim=0)}[pooling_type]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def assert_pooled_matches(
    vector,
    hf_model,
    ids: list[int],
    pooling_type: str,
    normalize: bool,
    atol: float = 1e-4,
    min_cosine: float = 0.9999,
) -> None:
    """An engine's embedding of ``ids`` against :func:`hf_pooled`: cosine and values (float32)."""
    got = torch.as_tensor(vector, dtype=torch.float32)
    expected = hf_pooled(hf_model, ids, pooling_type, normalize)
    cosine = float(torch.nn.functional.cosine_similarity(got, expected, dim=0))
    assert cosine >= min_cosine, f"{pooling_type} normalize={normalize}, {len(ids)} tokens: cosine {cosine}"
    torch.testing.assert_close(got, expected, atol=atol, rtol=1e-4)


def random_prompts(vocab_size: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def sorted_sampling_probs(
    logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float]
) -> torch.Tensor:
    """Plain math of temperature → top-k → top-p → min-p over the whole sorted vocabulary,
    one row at a time (what HF's and vLLM's samplers compute): the reference the engine's
    candidate-based sampler is checked against. ``top_k`` 0 means off."""
    out = []
    for row, t, k, p, m in zip(logits.float(), temperature, top_k, top_p, min_p):
        values, order = (row / t).sort(descending=True)
        if 0 < k < len(values):
            values[k:] = float("-inf")
        probs = values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        probs = torch.where((before < p) | (p >= 1), probs, 0)
        probs = torch.where(probs >= m * probs[0], probs, 0)
        out.append(torch.zeros_like(row).scatter_(0, order, probs / probs.sum()))
    return torch.stack(out)
