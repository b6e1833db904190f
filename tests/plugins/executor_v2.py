"""Test plugin for the executor seam: ``mp``'s ranks as an executor written to interface v2 would
run them, without ``sleep_mode_call`` (the interface's default runs it on rank 0 alone), so that
sleep mode is refused on its several ranks rather than half done."""

from __future__ import annotations

from engine import hookimpl
from engine.executors.multiproc import MultiprocExecutor
from engine.interfaces import Executor


class MultiprocV2(MultiprocExecutor):
    name = "test-mp-v2"
    sleep_mode_call = Executor.sleep_mode_call


@hookimpl
def register_executors(register):
    register("test-mp-v2", MultiprocV2, api=2)
