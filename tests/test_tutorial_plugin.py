"""The plugin tutorial's example (examples/attention/sdpa, built step by step in
docs/tutorial-plugin.md), run as the tutorial runs it: pip-installed from a copy, listed by
`engine plugins`, passing its conformance tests through `pytest --engine-conformance`, and
selected with `--plugins`, where it generates what the reference backend generates."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tests.plugin_packages import pip_install, pip_uninstall
from tests.test_plugins import run_engine

EXAMPLE = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "attention", "sdpa")


@pytest.fixture(scope="module")
def sdpa_plugin(tmp_path_factory):
    project = tmp_path_factory.mktemp("tutorial") / "attention-sdpa"
    shutil.copytree(EXAMPLE, project)  # a build in place would leave build/ and egg-info in the repo
    pip_install(project)
    yield project
    pip_uninstall("tessellm-attention-sdpa")


def test_engine_plugins_lists_it(sdpa_plugin):
    result = run_engine("plugins")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "attention-sdpa  (tessellm-attention-sdpa 0.1.0)  loaded" in lines
    assert "    attention backend: sdpa  [runs here]" in lines


@pytest.mark.slow  # a pytest session that imports every contract and runs its ~100 cases
def test_its_conformance_tests_pass(sdpa_plugin):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--engine-conformance",
            "-k",
            "sdpa",
        ],
        cwd=sdpa_plugin,
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    # its own TestSdpaAttention and the kit's generated class: the same cases each (their
    # number grows with the kit), nothing failed; the skips are the kit's cases for what the
    # backend refuses with reasons (windows, soft-caps, bidirectional, batch-invariant)
    passed = re.fullmatch(r"(\d+) passed(?:, (\d+) skipped)?(, \d+ deselected)? in .*", summary)
    assert passed and int(passed.group(1)) >= 98 and int(passed.group(1)) % 2 == 0, summary
    assert int(passed.group(2) or 0) % 2 == 0, summary


def test_it_generates_what_the_reference_backend_generates(sdpa_plugin, tiny_llama):
    args = [
        "generate",
        "--model",
        tiny_llama[0],
        "--prompt",
        "The sky is",
        "--max-tokens",
        "12",
        "--dtype",
        "float32",
        "--num-blocks",
        "64",
        "--max-model-len",
        "256",
    ]
    sdpa = run_engine("--plugins", "models-llama,attention-sdpa", *args, "--attention-backend", "sdpa")
    reference = run_engine("--plugins", "models-llama,attention-torch", *args)
    assert sdpa.returncode == 0 and reference.returncode == 0, sdpa.stderr + reference.stderr
    assert sdpa.stdout == reference.stdout and sdpa.stdout.strip()
