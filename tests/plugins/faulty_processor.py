"""Test plugin for step fault isolation: logits processors that raise.

``test-faulty`` raises for a request whose ``extra_args["fault_after"]`` is set, once it
has that many output tokens (a fault attributable to one request, mid-generation);
``test-broken`` raises on every call (a fault of the engine, not of any request)."""

from __future__ import annotations

from engine import hookimpl
from engine.interfaces import LogitsProcessor


class InjectedFault(RuntimeError):
    pass


@hookimpl
def register_logits_processors(register):
    register("test-faulty", FaultyForMarkedRequests, api=1)
    register("test-broken", AlwaysBroken, api=1)


class FaultyForMarkedRequests(LogitsProcessor):
    def apply(self, logits, requests):
        for request in requests:
            after = (request.sampling_params.extra_args or {}).get("fault_after")
            if after is not None and len(request.output_token_ids) >= after:
                raise InjectedFault(f"injected fault for {request.request_id}")
        return logits


class AlwaysBroken(LogitsProcessor):
    def apply(self, logits, requests):
        raise InjectedFault("this processor always fails")
