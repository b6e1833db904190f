"""The start-up summary and `engine serve --dry-run`: the plan names the parts the engine then
chooses and the same KV cache (bytes, blocks, tokens), its weights within 10% of what the loaded
model holds, and the dry run exits at once without loading weights or taking the port; once the
KV cache is full the process's resident memory is within the planned total."""

from __future__ import annotations

import subprocess
import time

from engine import LLM, SamplingParams
from engine.client import startup_plan
from engine.core import startup
from tests.serving import ENGINE

OPTIONS = dict(dtype="float32", max_model_len=256, kv_cache_memory=32 * 2**20, block_size=16)


def test_the_plan_is_what_the_engine_then_holds(tiny_llama):
    plan = startup_plan(dict(model=tiny_llama[0], **OPTIONS))
    llm = LLM(tiny_llama[0], **OPTIONS)
    report = llm.engine.startup
    started = report.render()
    for line in ("platform", "model", "weights", "attention", "kv_cache"):
        assert line in plan and line in started
    real_parts = started.splitlines()[1]
    assert plan.splitlines()[1] == real_parts  # the same parts chosen
    kv_note = next(n for n in report.notes if n.startswith("KV cache"))
    assert kv_note in plan
    planned = startup_memory(plan)
    assert abs(planned["kv_cache"] - report.memory["kv_cache"]) < 0.06 * 2**20  # printed to 0.1 MiB
    assert abs(planned["weights"] - report.memory["weights"]) <= 0.1 * report.memory["weights"]
    assert [name for name, _ in report.phases][:2] == ["config", "weights"]


def test_a_full_kv_cache_stays_within_the_planned_memory(tiny_llama):
    llm = LLM(tiny_llama[0], **OPTIONS)
    capacity = (llm.engine.num_blocks - 1) * 16
    prompts = [[1, *range(5 + i, 5 + i + 200)] for i in range(capacity // 200 + 2)]
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0), use_tqdm=False)
    assert startup.resident_bytes() <= 1.1 * sum(llm.engine.startup.memory.values())


def test_dry_run_prints_the_plan_and_exits_without_loading(tiny_llama):
    started = time.monotonic()
    run = subprocess.run(
        [ENGINE, "serve", tiny_llama[0], "--dry-run", "--dtype", "float32", "--port", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("engine start-up plan (dry run)") and "KV cache:" in run.stdout
    assert "Loading" not in run.stderr and time.monotonic() - started < 60  # no weights read


def startup_memory(text: str) -> dict[str, int]:
    """The memory line of a rendered report, back in bytes."""
    line = next(x for x in text.splitlines() if x.strip().startswith("memory"))
    out = {}
    for item in line.split("memory", 1)[1].split("·"):
        name, number, unit = item.split()
        out[name] = int(float(number) * (2**30 if unit == "GiB" else 2**20))
    return out
