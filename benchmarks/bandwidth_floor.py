"""Single-stream decode as a fraction of the bandwidth floor, in one run: this machine's memory
bandwidth, and the decode tokens/s of the default model and the 1B-class model (GGUF Q4 kept
quantized, and bf16).

    python benchmarks/bandwidth_floor.py [--only NAME ...] [--threads N] [--repeats 3] [--output-len 128]
                                         [--llama-python PATH]

A decode step of one stream reads every weight once, so it cannot run faster than the weight
bytes it reads ÷ the memory bandwidth: the floor on its time, here given as a ceiling on tokens/s
(bandwidth ÷ bytes read per token). The bandwidth is measured in this run, with the engine's
thread count, before a row's first decode round and after each of its rounds (all printed): a
shared machine's bandwidth moves within minutes (on a 2-core AMD EPYC the read sweep gave 43 GB/s
and 80 GB/s within ten minutes, 34 and 80 within three), so a floor from another moment would
say more about the neighbours than about the decode. The table takes the row's best round over
the best sweep of the row; a second table gives every round against the better of the two sweeps
on either side of it, and the median of those fractions, which a fast moment paired with a slow
one moves less.

- triad: STREAM's a = b + s·c over three float32 arrays of 256 MiB each (8× this kind of
  machine's 32 MiB L3), counted as STREAM counts it, 12 bytes an element (two reads, one write);
- read: a sum and a max over one 768 MiB array (the faster), 4 bytes an element.

A floor uses the larger of the two (the best of the sweeps it is taken from).
The floor bounds how fast decode could go, so it takes the most this memory delivered in the run:
the smaller figure would flatter the fraction. Decode's weight traffic is reads only, which argues
for the read sweep; but a triad's three streams a thread keep more misses in flight than one read
stream, and its count leaves out the write-allocate reads of ``a``, so on some machines it shows
the higher figure (on the shared 2-core AMD EPYC this was written on, either came out ahead by up to
~20 % from run to run).

Bytes read per token are the model's parameter and buffer bytes that one decode step reads:
every projection and norm whole, the LM head's table whole, but one row of a table that only serves
lookups (an untied input embedding, or the plain copy a tied bf16 table keeps for lookups beside
its prepacked head) and one row of the rotary cos/sin tables; copies that only batched steps read
(cpu-native's int8 LM head on AMX) are left out. The K/V cache the step also reads is
left out of the floor; its size at the run's mean context is printed (well under 5 % of the weights
here). Decode tokens/s are measured as ``quant.py``'s single stream: (n − 1) tokens over the time a
n-token run takes beyond a 1-token run, the best of ``--repeats`` rounds.

``--llama-python PATH`` (an interpreter with llama-cpp-python, e.g. a virtual environment's) also
times llama.cpp's single-stream decode on the same GGUF file with the same threads, in a subprocess
under that interpreter (``llama_cpp_bench.py``), for every GGUF row; each round runs the engine and
then llama.cpp, so the two alternate. The table adds llama.cpp's tokens/s, its fraction of the floor
and engine ÷ llama.cpp.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

import random_llama

ARRAY_BYTES = 256 << 20  # per triad array: far beyond the last-level cache
BANDWIDTH_REPEATS = 10
MODELS = ("default-q4_1", "default-bf16", "1b-q4_1", "1b-q4_0", "1b-bf16")


def triad_bandwidth(repeats: int = BANDWIDTH_REPEATS, array_bytes: int = ARRAY_BYTES) -> float:
    """Bytes/s of a = b + s·c on torch's threads (one fused loop), best of ``repeats``."""
    import torch

    n = array_bytes // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    torch.add(b, c, alpha=3.0, out=a)  # pages touched before the clock starts
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - start)
    return 3 * n * 4 / best


def read_bandwidth(repeats: int = BANDWIDTH_REPEATS, array_bytes: int = 3 * ARRAY_BYTES) -> float:
    """Bytes/s of reductions over one array on torch's threads (a sum and a max, whichever streams
    faster: neither is bound by its arithmetic, but their loops differ), best of ``repeats`` each."""
    import torch

    x = torch.rand(array_bytes // 4)
    best = float("inf")
    for reduce in (torch.sum, torch.amax):
        reduce(x)
        for _ in range(repeats):
            start = time.perf_counter()
            reduce(x)
            best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def measure_bandwidth() -> dict[str, float]:
    return {"triad": triad_bandwidth(), "read": read_bandwidth()}


def _tensors(module, recurse: bool = True) -> list:
    return [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]


def _table_reads(table) -> dict[int, int]:
    """Bytes a decode step reads of each tensor of a vocabulary table (``VocabEmbedding``): its
    logits tensors whole when it is the LM head; of its lookup tensors, when they are others, one
    row. The unquantized method keeps lookups on the plain ``weight`` and logits on a prepacked
    ``dense`` child; a quantized table serves both from one kernel."""
    own = _tensors(table, recurse=False)
    nested = [t for t in _tensors(table) if all(t is not o for o in own)]
    head = (nested or own) if table.serves_logits else []
    lookup = (own or nested) if table.serves_lookups else []
    reads = {id(t): t.numel() * t.element_size() for t in head}
    for t in lookup:
        reads.setdefault(id(t), t.numel() * t.element_size() // table.vocab_rows)
    return reads


def _batched_only(model) -> set[int]:
    """Ids of the tensors only batched steps read: those of modules marked ``batched_only``
    (cpu-native's int8 copy of an LM head, for steps of more than 16 rows on AMX)."""
    return {id(t) for m in model.modules() if getattr(m, "batched_only", False) for t in _tensors(m)}


def bytes_read_per_token(model) -> int:
    """The weight bytes one decode step of one stream reads (see the module docstring)."""
    from engine.layers.embedding import VocabEmbedding
    from engine.layers.rotary import RotaryEmbedding

    reads: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, VocabEmbedding):
            reads.update(_table_reads(module))
        elif isinstance(module, RotaryEmbedding):
            reads.update({id(t): t.numel() * t.element_size() // t.shape[0] for t in _tensors(module)})
    skipped = _batched_only(model)
    read = [t for t in _tensors(model) if id(t) not in skipped]
    return sum(reads.get(id(t), t.numel() * t.element_size()) for t in read)


def resident_bytes(model) -> int:
    """Every parameter and buffer, as ``quant.py``'s ``weight_mib`` counts them."""
    return sum(t.numel() * t.element_size() for t in _tensors(model))


def floor_tokens_per_s(bandwidth: float, bytes_per_token: int) -> float:
    """The fastest decode the bandwidth allows: every step streams its weight bytes once."""
    return bandwidth / bytes_per_token


def kv_bytes_per_context_token(hf_config, element_size: int = 2) -> int:
    """K and V of one context token over all layers (bf16 unless told)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim * element_size


def model_paths(name: str) -> tuple[str | None, dict]:
    """``LLM``'s model argument and options for one row: the default model's GGUF (kept quantized,
    or dequantized to bf16) or the 1B-class model's GGUF file or bf16 HF folder."""
    if name.startswith("default"):
        return None, {} if name.endswith("q4_1") else {"quantization": "unquantized"}
    return random_llama.row_path(name), {}


def gguf_file(name: str) -> str | None:
    """The GGUF file a row's weights come from, which llama.cpp loads; None for a bf16 row."""
    if name.endswith("bf16"):
        return None
    if name.startswith("default"):
        from engine_quant_gguf.loader import default_model_path

        return default_model_path()
    return random_llama.row_path(name)


def decode_row(name: str, output_len: int, repeats: int, llama_python: str | None = None, sweep=None) -> dict:
    """Load one model, measure its single-stream decode (and llama.cpp's on its GGUF file, in turn,
    round by round, when ``llama_python`` names an interpreter with llama-cpp-python), count what a
    step reads. With ``sweep`` (a function returning bandwidth figures in bytes/s by name), it runs
    before the first round and after every round: ``sweeps`` holds its results, ``rounds`` each
    round's (tokens/s, llama.cpp's or None, the best figure of the sweeps on either side)."""
    from llama_cpp_bench import single_stream_in
    from quant import PROMPT, engine_single

    from engine import LLM

    path, options = model_paths(name)
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, **options)
    model = llm.engine.model
    prompt_len = len(llm.apply_chat_template([{"role": "user", "content": PROMPT}]))  # token ids
    gguf = gguf_file(name) if llama_python else None
    threads = int(os.environ["ENGINE_NUM_THREADS"])  # main sets it: llama.cpp gets the engine's count
    sweeps, rounds = [sweep()] if sweep else [], []
    for _ in range(repeats):
        engine_tps = engine_single(llm, output_len, 1)
        llama_tps = single_stream_in(llama_python, gguf, threads, output_len, 1)[0] if gguf else None
        if sweep:
            sweeps.append(sweep())
        around = max(v for figures in sweeps[-2:] for v in figures.values()) if sweep else None
        rounds.append((engine_tps, llama_tps, around))
    engine_best = max(r[0] for r in rounds)
    llama_best = max(r[1] or 0.0 for r in rounds)
    row = {
        "name": name,
        "tokens_per_s": engine_best,
        "llama_cpp": llama_best or None,
        "read": bytes_read_per_token(model),
        "resident": resident_bytes(model),
        "kv": kv_bytes_per_context_token(model.cfg) * (prompt_len + output_len / 2),
        "sweeps": sweeps,
        "rounds": rounds,
    }
    del llm, model
    gc.collect()
    return row


def print_table(rows: list[dict]) -> None:
    llama = any(r["llama_cpp"] for r in rows)
    print(
        f"\n{'model':>13} | resident MiB | read/token MiB | K/V at mean ctx MiB | GB/s | floor tok/s | "
        "measured tok/s | of floor" + (" | llama.cpp tok/s | of floor | engine ÷ llama.cpp" if llama else "")
    )
    for r in rows:
        floor = floor_tokens_per_s(r["bandwidth"], r["read"])
        line = (
            f"{r['name']:>13} | {r['resident'] / 2**20:12.1f} | {r['read'] / 2**20:14.1f} | "
            f"{r['kv'] / 2**20:19.1f} | {r['bandwidth'] / 1e9:4.1f} | {floor:11.1f} | "
            f"{r['tokens_per_s']:14.1f} | {r['tokens_per_s'] / floor:8.0%}"
        )
        if r["llama_cpp"]:
            ratio = r["tokens_per_s"] / r["llama_cpp"]
            line += f" | {r['llama_cpp']:15.1f} | {r['llama_cpp'] / floor:8.0%} | {ratio:18.2f}"
        print(line)


def print_rounds(rows: list[dict]) -> None:
    """Each round against the bandwidth swept right before and after it, and the median of those
    fractions: on a shared machine whose bandwidth moves by half within minutes, the table's best
    round over the best sweep can pair a fast moment with a slow one either way."""
    llama = " | llama.cpp's" if any(r["llama_cpp"] for r in rows) else ""
    print(f"\n{'model':>13} | per round: tok/s at GB/s (of its floor) | median of floor{llama}")
    for r in rows:
        fractions = [tps / floor_tokens_per_s(bw, r["read"]) for tps, _, bw in r["rounds"]]
        cells = ", ".join(
            f"{tps:.1f} at {bw / 1e9:.1f} ({f:.0%})" for (tps, _, bw), f in zip(r["rounds"], fractions)
        )
        line = f"{r['name']:>13} | {cells} | {statistics.median(fractions):15.0%}"
        if r["llama_cpp"]:
            llama = [ltps / floor_tokens_per_s(bw, r["read"]) for _, ltps, bw in r["rounds"]]
            line += f" | {statistics.median(llama):11.0%}"
        print(line)


def bandwidth_line(figures: dict[str, float]) -> str:
    return f"triad {figures['triad'] / 1e9:.2f}, read {figures['read'] / 1e9:.2f} GB/s"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        help="models to decode (default: all): default-q4_1 / default-bf16, the embedded SmolLM2-135M "
        "GGUF kept quantized / dequantized to bf16; 1b-q4_1, 1b-q4_0, 1b-bf16, the 1B-class model's "
        "GGUF files (kept quantized) and bf16 HF folder, built on first use (random_llama.py)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="threads of the bandwidth kernels and of the engine (default: the engine's, every core "
        "this process may run on)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="decode rounds of each model, a bandwidth sweep after each; the first table takes the "
        "fastest, the second every one (default 3)",
    )
    parser.add_argument(
        "--output-len", type=int, default=128, help="tokens of the long decode run (default 128)"
    )
    parser.add_argument(
        "--llama-python",
        default=None,
        help="an interpreter with llama-cpp-python: also time llama.cpp's single-stream decode on each "
        "GGUF row's file, with the same threads, alternating with the engine's",
    )
    args = parser.parse_args()
    if args.llama_python and not (
        os.path.isfile(args.llama_python) and os.access(args.llama_python, os.X_OK)
    ):
        parser.error(f"--llama-python {args.llama_python}: not an executable file")
    threads = args.threads or len(os.sched_getaffinity(0))
    os.environ["ENGINE_NUM_THREADS"] = str(threads)  # the CPU platform sets torch's threads from it
    # before torch: the engine sets OpenMP's wait policy before libgomp loads
    importlib.import_module("engine")
    import torch

    torch.set_num_threads(threads)
    print(f"threads: {threads}")

    def sweep() -> dict[str, float]:
        torch.set_num_threads(threads)  # loading a model may have set torch's threads
        return measure_bandwidth()

    rows = []
    for name in args.only:
        row = decode_row(name, args.output_len, args.repeats, args.llama_python, sweep)
        row["bandwidth"] = max(v for figures in row["sweeps"] for v in figures.values())
        rows.append(row)
        llama = f", llama.cpp {row['llama_cpp']:.1f} tok/s" if row["llama_cpp"] else ""
        sweeps = "; ".join(bandwidth_line(figures) for figures in row["sweeps"])
        line = f"  {name}: {row['tokens_per_s']:.1f} tok/s{llama}; bandwidth between rounds {sweeps}"
        print(line, flush=True)
    print_table(rows)
    print_rounds(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
