"""spec-eagle: an EAGLE head drafts from the target's hidden states."""

from engine import hookimpl


@hookimpl
def register_drafters(register):
    register("eagle", "engine_spec_eagle.drafter:EagleDrafter", api=3)
