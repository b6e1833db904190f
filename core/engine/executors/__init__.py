"""The built-in executors: ``uni`` (the model runner in this process) and ``mp`` (this process
is rank 0 of N local tensor-parallel ranks; :mod:`engine.executors.worker` runs the others)."""
