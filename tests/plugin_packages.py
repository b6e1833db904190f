"""Real plugin packages for tests: written under a folder, pip-installed into this
environment (the engine finds plugins by their installed entry points), uninstalled after."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def write_plugin(root, distribution: str, entry_point: str, package: str, source: str):
    """A real plugin project (pyproject + one-module package) under ``root``; -> its folder."""
    project = root / distribution
    (project / package).mkdir(parents=True)
    (project / package / "__init__.py").write_text(textwrap.dedent(source))
    (project / "pyproject.toml").write_text(textwrap.dedent(f"""
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
        """))
    return project


def pip_install(*projects) -> None:
    subprocess.run([*PIP, "install", "--no-deps", "--no-build-isolation", *map(str, projects)], check=True,
                   capture_output=True, timeout=300)


def pip_uninstall(*distributions: str) -> None:
    subprocess.run([*PIP, "uninstall", "-y", *distributions], check=True, capture_output=True, timeout=120)
