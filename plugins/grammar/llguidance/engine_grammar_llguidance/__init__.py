"""grammar-llguidance: structured outputs compiled by llguidance."""

from engine import hookimpl


@hookimpl
def register_grammar_backends(register):
    # below xgrammar's priority (0): installing both keeps xgrammar the default backend, as in vLLM
    register("llguidance", "engine_grammar_llguidance.backend:LLGuidanceBackend", api=3, priority=-1)
