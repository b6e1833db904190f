"""How a front end drives the engine core, the same for every front end (``LLM``, ``engine
generate``, the server): an :class:`EngineCoreClient` takes requests and aborts and hands back
each step's :class:`Delta` messages and the :class:`~engine.messages.stats.EngineStats`, with the core in
this process (:class:`InProcessClient`) or in its own (:class:`AsyncMPClient`, and
:class:`AsyncEngine` routing its deltas to one stream per front-end request); one
:class:`OutputProcessor` turns deltas into text, stop strings and logprobs for all of them.
Names load on first use: a front end that keeps the core in another process imports no torch."""

_LAZY = {
    "EngineCoreClient": "engine.client.base",
    "InProcessClient": "engine.client.inproc",
    "AsyncMPClient": "engine.client.mp_client",
    "EngineDead": "engine.client.mp_client",
    "EngineStalled": "engine.client.async_engine",
    "AsyncEngine": "engine.client.async_engine",
    "RequestHandle": "engine.client.async_engine",
    "ShutdownCut": "engine.client.async_engine",
    "OutputProcessor": "engine.client.output_processor",
    "RequestState": "engine.client.output_processor",
    "request_output": "engine.client.output_processor",
    "SequenceOutput": "engine.client.sequence",
    "Delta": "engine.client.protocol",
    "Outputs": "engine.client.protocol",
    "Ready": "engine.client.protocol",
    "startup_plan": "engine.client.plan",
    "exit_now": "engine.lifetime",  # a front end's process ends so once its cores are closed
}

__all__ = [
    "AsyncEngine",
    "AsyncMPClient",
    "Delta",
    "EngineCoreClient",
    "EngineDead",
    "EngineStalled",
    "InProcessClient",
    "OutputProcessor",
    "Outputs",
    "Ready",
    "RequestHandle",
    "RequestState",
    "SequenceOutput",
    "ShutdownCut",
    "exit_now",
    "request_output",
    "startup_plan",
]  # the names _LAZY serves


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine.client' has no attribute {name!r}")
