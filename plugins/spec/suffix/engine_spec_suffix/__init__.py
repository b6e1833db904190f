"""spec-suffix: suffix-automaton drafting."""

from engine import hookimpl


@hookimpl
def register_drafters(register):
    register("suffix", "engine_spec_suffix.drafter:SuffixDrafter", api=1)
