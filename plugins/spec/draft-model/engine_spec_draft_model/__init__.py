"""spec-draft-model: a smaller model, or the target's own first layers, drafts."""

from engine import hookimpl


@hookimpl
def register_drafters(register):
    register("draft_model", "engine_spec_draft_model.drafter:DraftModelDrafter", api=1)
