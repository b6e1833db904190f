"""OpenMP's wait policy (engine.openmp): the engine's bounded spin reaches libgomp when nobody
chose one, a user's own choice is kept, and a process that loaded torch first is told the truth.
libgomp's own report (``OMP_DISPLAY_ENV``) is the evidence, read from a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from engine import openmp


def _spin_count(code: str, **variables: str) -> tuple[int, str]:
    """libgomp's spin count in a fresh interpreter running ``code`` with ``variables`` as the
    only OpenMP wait variables set, and what ``code`` printed."""
    env = {key: value for key, value in os.environ.items() if key not in openmp.WAIT_VARIABLES}
    env.update(variables, OMP_DISPLAY_ENV="VERBOSE")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    reported = re.search(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr)
    assert reported, done.stderr[-2000:]
    return int(reported.group(1)), done.stdout.strip()


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({}, openmp.SPIN_COUNT),
        ({"GOMP_SPINCOUNT": "1234"}, 1234),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, 0),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, 30_000_000_000),
    ],
    ids=["engine-default", "user-spin-count", "user-passive", "user-active"],
)
def test_libgomp_waits_as_chosen(variables, expected):
    code = "import engine, torch; from engine import openmp; print(openmp.wait_policy())"
    spin_count, policy = _spin_count(code, **variables)
    assert spin_count == expected
    assert ("the engine's default" in policy) == (not variables)


def test_torch_loaded_first_keeps_libgomps_default_and_says_so():
    code = "import torch, engine, os; print(engine.openmp.wait_policy(), os.environ['GOMP_SPINCOUNT'])"
    spin_count, policy = _spin_count(code)
    assert spin_count == 300_000  # libgomp's own default
    assert policy.startswith("libgomp's default") and policy.endswith(str(openmp.SPIN_COUNT))


def test_a_users_variable_is_left_alone_and_an_unset_one_filled_in():
    environ = {"OMP_WAIT_POLICY": "passive"}
    assert openmp.choose_wait_policy(environ) == "OMP_WAIT_POLICY=passive (from the environment)"
    assert environ == {"OMP_WAIT_POLICY": "passive"}
    environ = {}
    openmp.choose_wait_policy(environ)
    assert environ == {"GOMP_SPINCOUNT": str(openmp.SPIN_COUNT)}
