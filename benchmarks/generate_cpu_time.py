"""Generation speed of the default config, for comparing two trees in alternated processes: N
prompts of 32 token ids × L greedy tokens (``ignore_eos``), timed around one ``generate`` after an
8-token warm-up, in output tokens per wall second and per CPU second of the process (user + sys:
what other processes holding the cores move far less than wall time).

    ENGINE_NUM_THREADS=1 python benchmarks/generate_cpu_time.py N L [--dtype auto] [--kv-cache-dtype auto]

Prints one JSON line: the rates, the load average, the activation and KV cache dtypes the engine
resolved, and its KV cache blocks (capacity) in 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prompts", type=int)
    parser.add_argument("length", type=int)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    from engine import LLM, SamplingParams

    llm = LLM(kv_cache_memory=2**30, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype)
    ids = [[(17 * i + 31 * j) % 40000 + 100 for j in range(32)] for i in range(args.prompts)]
    prompts = [{"prompt_token_ids": p} for p in ids]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(max_tokens=args.length, temperature=0, ignore_eos=True)
    cpu, wall = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    config = llm.engine.config
    print(
        json.dumps(
            dict(
                prompts=args.prompts,
                length=args.length,
                wall_tok_s=round(tokens / wall, 2),
                tok_per_cpu_s=round(tokens / cpu, 2),
                load=round(os.getloadavg()[0], 1),
                dtype=config.model.dtype,
                kv_cache_dtype=config.cache.kv_cache_dtype,
                blocks=llm.engine.num_blocks,
            )
        )
    )


if __name__ == "__main__":
    main()
