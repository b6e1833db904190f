"""Every distribution of the project carries the project's name, and depends only on the
project's own distributions or on well-known libraries: a dependency named like ours but
not ours (``engine-core`` is an unrelated PyPI project) would be resolved from the index."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "tessellm"
PLUGIN_FOLDERS = ("plugins", "examples")  # <folder>/<kind>/<name>/: examples are plugins too
# the project's own distributions only: never a virtual environment's packages beside them
DISTRIBUTIONS = sorted(
    p.parent
    for pattern in ("core", "server", "plugins/*/*", "examples/*/*")
    for p in ROOT.glob(f"{pattern}/pyproject.toml")
)

# Third-party libraries a distribution may name: each widely used and published by its own
# maintainers (torch, Hugging Face, Prometheus, ZeroMQ ...).
WELL_KNOWN = {
    "torch",
    "triton",
    "numpy",
    "pillow",
    "safetensors",
    "transformers",
    "tokenizers",
    "gguf",
    "jinja2",
    "tqdm",
    "pluggy",
    "attrs",
    "xgrammar",
    "llguidance",
    "starlette",
    "uvicorn",
    "uvloop",
    "httptools",
    "pyzmq",
    "msgspec",
    "prometheus-client",
    "httpx",
    "openai",
    "anthropic",
    "pytest",
    "hypothesis",
    "setuptools",
    "jsonschema",
    "pyyaml",
    "schemathesis",
    "selenium",
    "opentelemetry-sdk",
    "opentelemetry-exporter-otlp-proto-http",
    "flash-attn",
    "flashinfer-python",
    "ray",
    "nixl-cu12",
    "peft",
    "bitsandbytes",
    "openai-harmony",
}
# Less known packages a distribution may name in an extra only, for data the code checks by hash
# before using it: quicktok-v1 carries o200k's vocabulary, and the file rebuilt from it must have
# the SHA-256 openai-harmony expects (engine_server.harmony).
HASH_CHECKED_DATA = {"quicktok-v1"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


def _project(path: Path) -> dict:
    return tomllib.loads((path / "pyproject.toml").read_text())["project"]


def _expected_name(path: Path) -> str:
    relative = path.relative_to(ROOT).parts
    if relative[0] in PLUGIN_FOLDERS:
        return f"{PROJECT}-{relative[1]}-{relative[2]}"
    return f"{PROJECT}-{relative[0]}"


@pytest.mark.parametrize("path", DISTRIBUTIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_distribution_named_after_the_project(path):
    project = _project(path)
    assert project["name"] == _expected_name(path)
    relative = path.relative_to(ROOT).parts
    if relative[0] in PLUGIN_FOLDERS:
        kind, name = relative[1:3]
        entry_points = project["entry-points"]["engine.plugins"]
        assert entry_points == {f"{kind}-{name}": f"engine_{kind}_{name.replace('-', '_')}"}


@pytest.mark.parametrize("path", DISTRIBUTIONS, ids=lambda p: str(p.relative_to(ROOT)))
def test_dependencies_are_ours_or_well_known(path):
    project = _project(path)
    required = list(project.get("dependencies", []))
    optional = [r for extra in project.get("optional-dependencies", {}).values() for r in extra]
    ours = {_expected_name(p) for p in DISTRIBUTIONS}
    for requirement in required + optional:
        name = _name(requirement)
        checked_data = name in HASH_CHECKED_DATA and requirement in optional
        assert name in ours or name in WELL_KNOWN or checked_data, (
            f"{path.name}: {requirement!r} is neither ours nor well known"
        )
        assert not name.startswith("engine-"), f"{requirement!r}: `engine-*` names belong to other projects"


@pytest.mark.slow
def test_plugin_install_resolves_our_names_only_locally(tmp_path):
    """``pip install plugins/quant/gguf`` beside a locally built core wheel, with the package
    index reachable: every ``tessellm-*`` distribution pip would install comes from here."""
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT / "core")],
        check=True,
        capture_output=True,
        timeout=300,
    )
    report = tmp_path / "report.json"
    # --ignore-installed: resolve as a fresh environment would, without installing anything.
    subprocess.run(
        [
            *pip,
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-build-isolation",
            "--report",
            str(report),
            "--find-links",
            str(wheels),
            str(ROOT / "plugins/quant/gguf"),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    installs = json.loads(report.read_text())["install"]
    ours = {
        item["metadata"]["name"]: item["download_info"]["url"]
        for item in installs
        if item["metadata"]["name"].lower().startswith(PROJECT)
    }
    assert set(ours) == {"tessellm-core", "tessellm-quant-gguf"}
    assert all(url.startswith("file://") for url in ours.values()), ours
    assert not any(item["metadata"]["name"].lower().startswith("engine-") for item in installs)
