"""UniprocExecutor: one rank, the model runner in the engine core's own process."""

from __future__ import annotations

from engine.distributed import SINGLE, TensorParallel
from engine.interfaces import Executor


class UniprocExecutor(Executor):
    name = "uni"

    @classmethod
    def supports(cls, config) -> list[str]:
        size = config.parallel.tensor_parallel_size
        return [f"it runs one rank; tensor_parallel_size is {size} (use mp)"] if size > 1 else []

    @property
    def tensor_parallel(self) -> TensorParallel:
        return SINGLE

    def start(self, runner, kv_groups) -> None:
        self.runner = runner
        self.model = runner.model

    def execute(self, plan, group_tables, bitmask=None, kv_meta=None):
        return self.runner.execute(plan, group_tables, bitmask, kv_meta)

    def weight_bytes_read(self) -> list[int | None]:
        return [getattr(self.model, "weight_bytes_read", None)]
