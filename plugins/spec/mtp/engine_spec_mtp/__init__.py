"""spec-mtp: the target checkpoint's multi-token-prediction module drafts (DeepSeek-V3)."""

from engine import hookimpl

# vLLM's names: "deepseek_mtp" for DeepSeek-V3, "mtp" for any model with an MTP module
METHODS = ("deepseek_mtp", "mtp")


@hookimpl
def register_drafters(register):
    for method in METHODS:
        register(method, "engine_spec_mtp.drafter:MTPDrafter", api=2)
