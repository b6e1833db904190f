"""spec-ngram: prompt-lookup drafting."""

from engine import hookimpl


@hookimpl
def register_drafters(register):
    register("ngram", "engine_spec_ngram.drafter:NgramDrafter", api=1)
