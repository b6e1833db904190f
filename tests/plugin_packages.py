"""Real plugin packages for tests: written under a folder, pip-installed into this
environment (the engine finds plugins by their installed entry points), uninstalled after;
or written as installed distributions into a folder put on the path (no pip, nothing shared
changes)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def write_plugin(root, distribution: str, entry_point: str, package: str, source: str):
    """A real plugin project (pyproject + one-module package) under ``root``; -> its folder."""
    project = root / distribution
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text(textwrap.dedent(source))
    (project / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{distribution}"
        version = "9.0.0"

        [project.entry-points."engine.plugins"]
        {entry_point} = "{package}"

        [tool.setuptools]
        packages = ["{package}"]
        """)
    )
    return project


def pip_install(*projects) -> None:
    subprocess.run(
        [*PIP, "install", "--no-deps", "--no-build-isolation", *map(str, projects)],
        check=True,
        capture_output=True,
        timeout=300,
    )


def pip_uninstall(*distributions: str) -> None:
    subprocess.run([*PIP, "uninstall", "-y", *distributions], check=True, capture_output=True, timeout=120)


def write_distribution(
    site, distribution: str, entry_point: str, package: str, source: str, version: str = "9.0.0"
):
    """A plugin as an installer leaves it — its package and a ``.dist-info`` naming its entry
    point — under ``site``, a folder to put on ``sys.path`` (``PYTHONPATH`` for a subprocess):
    ``importlib.metadata`` finds it there and the shared environment stays untouched. -> the
    package's folder."""
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text(textwrap.dedent(source))
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[engine.plugins]\n{entry_point} = {package}\n")
    return site / package


def environ_with(site) -> dict[str, str]:
    """This process's environment with ``site`` first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env
