"""The default model's decode step with the LM head's int8 copy (cpu-native on AMX: batched
logits on int8 tiles) and without it (the group-affine bf16 tiles), alternated in one process.

    python benchmarks/lm_head_int8.py [--batches 64 256] [--rounds 4] [--steps 16]

One ``LLM()`` (the default config); for each batch size, rounds of ``--steps`` decode steps
with every prompt in the batch (``offline_throughput.decode_steps``), the copy switched on and
off between them in turn (on, off, off, on, ...). Prints each round's median step in ms and the
ratio of the two sums (off ÷ on: above 1 when the copy is faster). Needs a CPU with AMX int8
tiles (the copy exists only there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="decode batch sizes")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each variant per batch size")
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps a round")
    args = parser.parse_args()

    from offline_throughput import decode_steps, make_prompts

    from engine import LLM
    from engine_platforms_cpu_native.affine import PackedAffine

    llm = LLM()
    packed = [m for m in llm.engine.model.modules() if isinstance(m, PackedAffine)]
    tables = [m for m in packed if m.int8_table is not None]
    if len(tables) != 1:
        sys.exit("no LM head with an int8 copy here: it needs cpu-native on a CPU with AMX int8 tiles")
    (table,) = tables
    copy = table.int8_table
    for batch in args.batches:
        prompts = make_prompts(llm.tokenizer, batch)
        medians: dict[str, list[float]] = {"int8 copy": [], "bf16 tiles": []}
        for r in range(args.rounds):
            for name in ("int8 copy", "bf16 tiles") if r % 2 == 0 else ("bf16 tiles", "int8 copy"):
                table.int8_table = copy if name == "int8 copy" else None
                medians[name].append(statistics.median(decode_steps(llm, prompts, args.steps)) * 1e3)
        table.int8_table = copy
        rounds = "; ".join(f"{name} " + " ".join(f"{m:.1f}" for m in ms) for name, ms in medians.items())
        ratio = sum(medians["bf16 tiles"]) / sum(medians["int8 copy"])
        print(f"batch {batch}: step ms by round: {rounds}; bf16 tiles ÷ int8 copy {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
