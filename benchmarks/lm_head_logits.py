"""The LM head's cost on the cpu-native packed kernel: ``PackedAffine.forward`` (int8 activations)
against ``.logits`` (each row's largest logits recomputed from the unrounded activations), on a
random Q8_0 table of the default model's shape (49,152 × 576), one thread, CPU time per call.

    python benchmarks/lm_head_logits.py [--rows 1 16 64] [--refined 0 16 32 64] [--rounds 5]

Prints, per row count, the median over alternated rounds of each variant's ms per call.
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def random_q8_0_table(n: int = 49152, k: int = 576):
    from engine_platforms_cpu_native import affine

    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (n, k // 32 * 34), generator=gen, dtype=torch.uint8)
    raw.view(n, k // 32, 34)[:, :, 0:2] = torch.tensor([0x00, 0x20], dtype=torch.uint8)  # d: a small float16
    return affine.PackedAffine.from_blocks(raw, "ggml:q8_0", torch.float32)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--refined", type=int, nargs="+", default=[0, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from engine_platforms_cpu_native import affine

    head = random_q8_0_table()
    for rows in args.rows:
        x = torch.randn(rows, head.in_features)
        calls = max(3, 60 // rows)
        times: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for variant in ["int8", *args.refined]:
                start = cpu_seconds()
                for _ in range(calls):
                    if variant == "int8":
                        head(x)
                    else:
                        affine.LOGITS_REFINED = variant
                        head.logits(x)
                times.setdefault(str(variant), []).append((cpu_seconds() - start) / calls * 1e3)
        cells = "  ".join(f"{name}: {statistics.median(t):.2f} ms" for name, t in times.items())
        print(f"rows {rows}  {cells}", flush=True)


if __name__ == "__main__":
    main()
