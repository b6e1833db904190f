"""pytest plugin (entry point ``pytest11``): ``pytest --engine-conformance`` runs every
contract against everything the installed plugins register."""

from __future__ import annotations

import os


def pytest_addoption(parser):
    parser.addoption(
        "--engine-conformance",
        action="store_true",
        default=False,
        help="run the engine's contract tests against every installed plugin",
    )


def pytest_configure(config):
    if config.getoption("--engine-conformance"):
        config.args.append(os.path.join(os.path.dirname(__file__), "conformance_all.py"))
