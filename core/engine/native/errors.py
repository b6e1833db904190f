"""The error of :mod:`engine.native`, in a module of its own so that its parts can raise it."""


class BuildError(RuntimeError):
    """A native library cannot be built or bound here (it says why)."""
