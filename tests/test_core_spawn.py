"""The engine-core process started early (``engine serve`` starts it before it has parsed its
command line, so both processes import side by side): handed its arguments it runs with them;
asked for pinned CPUs, a new core starts pinned and the early one is ended; unneeded, it exits
quietly. Real processes of ``python -m engine.client.core_process``."""

from __future__ import annotations

import os
import subprocess
import sys

from engine.client import spawn


def test_a_core_started_early_runs_with_the_arguments_it_is_handed(capfd):
    early = spawn.start_early()
    process = spawn.spawn_core(["--help"])
    assert process is early
    assert process.wait(timeout=120) == 0
    assert "--parent-pid" in capfd.readouterr().out  # argparse's help: the arguments arrived


def test_a_pinned_core_is_a_new_process_and_the_early_one_ends(capfd):
    early = spawn.start_early()
    cpu = min(os.sched_getaffinity(0))
    process = spawn.spawn_core(["--help"], cpus={cpu})
    assert process is not early and early.poll() is not None
    assert os.sched_getaffinity(process.pid) == {cpu}
    assert process.wait(timeout=120) == 0
    assert "--parent-pid" in capfd.readouterr().out


def test_an_early_core_whose_front_end_exits_without_it_exits_quietly():
    """A front end that fails before it spawns (an unknown flag) just exits: its end of the
    pipe closes, the core reads no arguments and exits too. ``run`` returns only once every
    holder of its output pipes is gone, the core included."""
    front_end = "from engine.client.spawn import start_early; start_early()"
    run = subprocess.run(
        [sys.executable, "-c", front_end], check=False, capture_output=True, text=True, timeout=120
    )
    assert (run.returncode, run.stdout, run.stderr) == (0, "", "")
