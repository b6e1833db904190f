"""Multi-head latent attention: one layer's decode step on the paged latent cache — the C kernel
(``mla-cpu-native``: the latent pages attended in place in C), mla-torch's absorbed path (the
same attention on the latent pages in torch) and its naive path (the context decompressed into
per-head K/V every step) — and the KV bytes per token of each layout.

    python benchmarks/mla.py [--batches 1 16 64] [--context 4096] [--repeats 3] [--threads N]
                             [--shape v2-lite|v3] [--no-naive]

The shape is DeepSeek-V2-Lite's attention (16 heads) or V3's (128 heads): kv_lora_rank 512,
rope 64, nope 128, value 128, bf16, blocks of 16 tokens scattered over the pool. Each batch
row is one request of ``--context`` cached tokens decoding one more; the three calls are
interleaved (``attention.time_calls``), median of ``--repeats``; ``--no-naive`` leaves the naive
path out (it takes over a minute a call at batch 64).
"""

from __future__ import annotations

import argparse

import torch
from attention import time_calls

from engine.builtin.platforms import CpuPlatform
from engine.interfaces import AttentionSpec, BatchLayout, LatentUpProjection, PagedLatent
from engine.plugins import load_plugins

RANK, ROPE, NOPE, VALUE, BLOCK = 512, 64, 128, 128, 16
HEADS = {"v2-lite": 16, "v3": 128}


def spec(heads: int) -> AttentionSpec:
    return AttentionSpec(heads, 1, NOPE + ROPE, torch.bfloat16, BLOCK, latent=PagedLatent(RANK, ROPE))


def kv_bytes_per_token(heads: int) -> dict[str, int]:
    """Per layer, bf16: the latent vector against per-head keys (nope + rope) and values."""
    return {
        "paged-latent": (RANK + ROPE) * 2,
        "per-head K/V (decompressed)": heads * (NOPE + ROPE + VALUE) * 2,
    }


def decode_layout(batch: int, context: int, gen: torch.Generator) -> tuple[BatchLayout, int]:
    """``batch`` requests of ``context`` cached tokens plus one new, blocks scattered."""
    per_request = -(-(context + 1) // BLOCK)
    num_blocks = batch * per_request + 1
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).view(batch, per_request).int()
    slots = tables[:, context // BLOCK].long() * BLOCK + context % BLOCK
    layout = BatchLayout(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), context + 1, dtype=torch.int32),
        block_table=tables,
        slot_mapping=slots,
        query_lens=(1,) * batch,
        seq_lens_host=(context + 1,) * batch,
    )
    return layout, num_blocks


def measure(heads: int, batch: int, context: int, repeats: int, naive: bool) -> dict[str, float]:
    registry, platform, gen = load_plugins(), CpuPlatform(), torch.Generator().manual_seed(0)
    layout, num_blocks = decode_layout(batch, context, gen)
    torch_mla = registry.get("attention_backends", "mla-torch")
    backends = {
        "c": registry.get("attention_backends", "mla-cpu-native")(spec(heads), platform, registry=registry),
        **{
            path: torch_mla(spec(heads), platform, decode_path=path)
            for path in ("absorbed", "naive")
            if naive or path == "absorbed"
        },
    }
    cache = (torch.randn(num_blocks, BLOCK, RANK + ROPE, generator=gen) * 0.5).to(torch.bfloat16)
    up = LatentUpProjection(
        (torch.randn(heads, NOPE, RANK, generator=gen) * RANK**-0.5).to(torch.bfloat16),
        (torch.randn(heads, VALUE, RANK, generator=gen) * RANK**-0.5).to(torch.bfloat16),
    )
    inputs = [
        torch.randn(batch, heads, NOPE, generator=gen).bfloat16(),
        torch.randn(batch, heads, ROPE, generator=gen).bfloat16(),
        torch.randn(batch, RANK, generator=gen).bfloat16(),
        torch.randn(batch, ROPE, generator=gen).bfloat16(),
    ]
    metadata = {path: backend.build_metadata(layout) for path, backend in backends.items()}
    outputs = {path: backends[path].forward_latent(*inputs, cache, metadata[path], up) for path in backends}
    drift = {
        f"max |{path} - absorbed|": (outputs[path].float() - outputs["absorbed"].float()).abs().max().item()
        for path in backends
        if path != "absorbed"
    }
    calls = {
        path: (lambda b=backend, m=metadata[path]: b.forward_latent(*inputs, cache, m, up))
        for path, backend in backends.items()
    }
    return time_calls(calls, repeats) | drift


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--shape", choices=sorted(HEADS), default="v2-lite")
    parser.add_argument("--no-naive", action="store_true", help="leave the naive path out")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = HEADS[args.shape]
    for layout, size in kv_bytes_per_token(heads).items():
        print(f"KV bytes per token and layer, {layout}: {size}")
    print(
        f"one layer's decode, {args.shape} ({heads} heads), context {args.context}, bf16, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}"
    )
    print(
        f"{'batch':>5} {'C ms':>8} {'absorbed ms':>12} {'naive ms':>10} {'absorbed/C':>10} {'naive/C':>8} "
        f"{'|C-abs|':>8} {'|naive-abs|':>11}"
    )
    with torch.inference_mode():
        for batch in args.batches:
            t = measure(heads, batch, args.context, args.repeats, not args.no_naive)
            naive = t.get("naive", float("nan"))
            print(
                f"{batch:>5} {t['c'] * 1e3:>8.2f} {t['absorbed'] * 1e3:>12.2f} {naive * 1e3:>10.2f} "
                f"{t['absorbed'] / t['c']:>9.1f}x {naive / t['c']:>7.1f}x "
                f"{t['max |c - absorbed|']:>8.1e} {t.get('max |naive - absorbed|', float('nan')):>11.1e}"
            )


if __name__ == "__main__":
    main()
