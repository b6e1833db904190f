"""Time to first token of a request whose long shared prefix the KV pool has evicted: recomputed
(no connector) against reloaded from the offload connector's CPU tier, side by side in one run.

    python benchmarks/kv_offload.py [--prefix-len 2048] [--reps 5] [--model PATH] [--dtype float32]

Two engines with the same small pool (the prefix and one other prompt of the same length do not
fit together): one plain, one with ``kv_connector=offload``. Each repetition, in each engine in
turn (A B A B ...): a prompt with a fresh prefix computes it (one token), another prompt of the
same length evicts it from the pool, then the timed request — the prefix and a short tail, one
token — recomputes the prefix or reloads it. The median TTFTs and their ratio are printed, with a
check that both engines chose the same token. Without ``--model`` a random Llama (hidden 512,
8 layers, 8 heads, 4 KV heads, max_position_embeddings 4096) is built in a temporary folder.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

BLOCK = 16
TAIL = 16


def random_llama(folder: str) -> str:
    from engine.testing import reference

    reference.tiny_checkpoint(
        folder,
        "LlamaForCausalLM",
        dict(
            model_type="llama",
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1408,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=4096,
        ),
    )
    return folder


def engines(model: str, prefix_len: int, dtype: str):
    from engine import LLM

    num_blocks = (prefix_len + 2 * TAIL) // BLOCK + 2  # one long prompt fits: the next evicts its blocks
    options = dict(
        dtype=dtype,
        block_size=BLOCK,
        num_blocks=num_blocks,
        max_model_len=prefix_len + 2 * TAIL,
        max_num_seqs=1,
    )
    offload = {"kv_connector": "offload", "kv_connector_extra_config": {"cpu_bytes": 8 << 30}}
    return {"recompute": LLM(model, **options), "offload": LLM(model, kv_transfer_config=offload, **options)}


def timed_reload(llm, vocab: int, prefix_len: int, seed: int) -> tuple[float, int]:
    """(TTFT seconds of the timed request, its token) after computing and evicting its prefix."""
    from engine import SamplingParams
    from engine.testing import reference

    prefix, other, tail_a, tail_b = reference.random_prompts(
        vocab, [prefix_len, prefix_len, TAIL, TAIL], seed=seed
    )
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([prefix + tail_a], one)
    llm.generate([other + tail_a], one)  # takes the pool: the prefix is evicted
    start = time.perf_counter()
    out = llm.generate([prefix + tail_b], one)[0]
    return time.perf_counter() - start, out.outputs[0].token_ids[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefix-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--model", default=None, help="a checkpoint folder; default: a random Llama")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = args.model or random_llama(folder)
        llms = engines(model, args.prefix_len, args.dtype)
        vocab = llms["recompute"].engine.hf_config.vocab_size
        for llm in llms.values():  # warm-up
            timed_reload(llm, vocab, args.prefix_len, seed=1000)
        times: dict[str, list[float]] = {name: [] for name in llms}
        for rep in range(args.reps):
            tokens = {}
            for name, llm in llms.items():
                seconds, tokens[name] = timed_reload(llm, vocab, args.prefix_len, seed=rep)
                times[name].append(seconds)
            print(
                f"rep {rep}: "
                + ", ".join(f"{n} {times[n][-1] * 1000:.1f} ms" for n in llms)
                + ("" if len(set(tokens.values())) == 1 else f"  TOKENS DIFFER {tokens}")
            )
        stats = llms["offload"].engine.stats()
        median = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"prefix {args.prefix_len} tokens, {args.reps} reps, median TTFT: recompute "
            f"{median['recompute'] * 1000:.1f} ms, offload reload {median['offload'] * 1000:.1f} ms, "
            f"ratio {median['recompute'] / median['offload']:.1f}x"
        )
        local = llms["recompute"].engine.stats()["prefix_hits"] / (args.reps + 1)
        print(
            f"recompute engine: {local:.0f} prompt tokens of each timed request still in the pool (the rest "
            "computed)"
        )
        print(
            f"offload: {stats['external_prefix_hits']} tokens loaded, "
            f"{stats['kv_load_bytes'] / 2**20:.0f} MiB in {stats['kv_load_seconds']:.3f} s, "
            f"{stats['kv_load_failures']} failed loads"
        )


if __name__ == "__main__":
    main()
