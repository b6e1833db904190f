"""Runs a conformance kit, in a child pytest as a plugin's own tests run it, on a correct plugin
and on mutants of it (copies with one planted bug each), and reports every kit test's outcome
per plugin. The ``tests/test_*_kit_mutations.py`` files use it to check that each kit fails
each planted bug, in the test written for it, and passes the correct plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
Outcomes = dict[str, dict[str, str]]  # {plugin: {kit test: "passed" | "failed" | "skipped"}}


def class_name(plugin: str) -> str:
    """The kit subclass a child test file defines for ``plugin``: ``Test_<name>``."""
    return "Test_" + plugin.replace("-", "_")


def run_kit(folder: Path, source: str, *pytest_args: str, timeout: int = 600) -> Outcomes:
    """Writes ``source`` (kit subclasses named by :func:`class_name`) as a test file in
    ``folder``, runs pytest on it in a child process and returns the outcome of each test."""
    (folder / "test_kit.py").write_text(source)
    report = folder / "report.xml"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
    command += ["-W", "error::pytest.PytestRemovedIn10Warning", *pytest_args, str(folder / "test_kit.py")]
    run = subprocess.run(
        command, check=False, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert report.exists(), run.stdout + run.stderr
    results: Outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        plugin = case.get("classname").rsplit(".Test_", 1)[1].replace("_", "-")
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        results.setdefault(plugin, {})[case.get("name")] = outcome
    return results


def failed(outcomes: Outcomes, plugin: str) -> list[str]:
    return sorted(test for test, outcome in outcomes.get(plugin, {}).items() if outcome == "failed")
