"""The ``engine`` command. It imports nothing heavy before it knows the subcommand: for ``engine
serve`` it first starts the engine-core process (:func:`engine.client.spawn.start_early`), so
that the core imports torch and transformers while this process imports its own and parses the
command line; then it runs :func:`engine.entrypoints.cli.main`."""

from __future__ import annotations

import sys

from engine.client.spawn import start_early

NO_CORE_FLAGS = {"-h", "--help", "--dry-run"}  # `engine serve` runs no core with these


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["serve"] and not NO_CORE_FLAGS.intersection(argv):
        start_early()
    from engine.entrypoints.cli import main as run

    return run(argv)
