"""executors-ray: ``--distributed-executor-backend ray``. The engine core stays rank 0 (the
driver) and the other tensor-parallel ranks run the core's worker as Ray actors in one
placement group, on this machine or across a Ray cluster. ``ray`` is imported only when the
executor is selected."""

from engine import hookimpl


@hookimpl
def register_executors(register):
    register("ray", "engine_executors_ray.executor:RayExecutor", api=3)
