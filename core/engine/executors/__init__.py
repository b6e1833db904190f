"""The built-in executors: ``uni`` (the model runner in this process) and ``mp`` (this process
is rank 0 of N local tensor-parallel ranks; :mod:`engine.executors.worker` runs the others).
:mod:`engine.executors.driver` is what every multi-rank executor shares (an executor plugin
such as ray subclasses its ``DriverExecutor`` and places the same workers elsewhere)."""
