"""The CPU platform's heap (engine.builtin.heap): a configured engine process reuses a freed
50 MB block (a 256-row decode step's logits) instead of faulting in fresh pages every step, a
user's own glibc thresholds are kept, and the free pages go back where memory is counted. Each
case runs in a fresh interpreter: the thresholds are the process's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine.builtin import heap

pytestmark = pytest.mark.skipif(heap._glibc() is None, reason="glibc's mallopt")

STEPS = """
import resource, torch
from engine.builtin import heap
print(heap.keep_freed_blocks() if CONFIGURE else "default")
def step():
    logits = torch.empty(256, 49152)
    logits.fill_(1.0)
for _ in range(40):  # the heap settles
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 10)
"""


def _run(code: str, **variables: str) -> list[str]:
    env = {
        key: value for key, value in os.environ.items() if key not in (*heap.USER_SETTINGS, "GLIBC_TUNABLES")
    }
    env.update(variables)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return done.stdout.split("\n")


def test_a_step_reuses_its_freed_logits_block():
    policy, faults = _run("CONFIGURE = True" + STEPS)[:2]
    assert policy == "freed blocks up to 1024 MiB kept for reuse"
    assert int(faults) < 100
    default = _run("CONFIGURE = False" + STEPS)[1]
    assert int(default) > 10_000  # 50 MB mapped and faulted in 4 KiB pages every step


def test_a_users_threshold_is_kept():
    policy, faults = _run("CONFIGURE = True" + STEPS, MALLOC_MMAP_THRESHOLD_="65536")[:2]
    assert policy == "glibc's thresholds from the environment (MALLOC_MMAP_THRESHOLD_)"
    assert int(faults) > 10_000


def test_free_memory_gives_the_heaps_free_pages_back():
    code = """
import torch
from engine.builtin.platforms import CpuPlatform
from engine.builtin import heap
heap.keep_freed_blocks()
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
kept = [torch.ones(64, 1 << 20) for _ in range(2)]  # 512 MiB
base = resident()
del kept
print(base - resident())
CpuPlatform().free_memory()
print(base - resident())
"""
    kept, given_back = (int(line) for line in _run(code)[:2])
    assert kept < 64 << 20
    assert given_back > 448 << 20
