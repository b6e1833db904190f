"""The draft-model drafter against the drafter contract: a separate tiny draft model (same
vocabulary), and layer-skip self-drafting with the target's first layers."""

import pytest

from engine.testing import reference
from engine.testing.spec import TINY, DrafterContract


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("draft"))
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", {**TINY, "num_hidden_layers": 1}, seed=9)
    return folder


class TestSeparateDraftModel(DrafterContract):
    speculative_config = {"method": "draft_model", "num_speculative_tokens": 3, "model": "{draft_dir}"}

    @pytest.fixture(autouse=True)
    def _draft(self, draft_dir):
        self.draft_dir = draft_dir

    def config(self, model_dir):
        return {**self.speculative_config, "model": self.draft_dir}


class TestSelfDraft(DrafterContract):
    speculative_config = {"method": "draft_model", "num_speculative_tokens": 3, "self_draft_layers": 2}


def test_a_draft_identical_to_the_target_is_always_accepted(tmp_path):
    """Same weights, same greedy choices: every draft must be accepted (checks that the
    draft's catch-up, positions and KV cache line up with the target's)."""
    from engine import LLM, SamplingParams
    from engine.testing.spec import OPTIONS

    folder = str(tmp_path / "same")
    reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY, seed=5)
    llm = LLM(
        folder,
        **OPTIONS,
        speculative_config={"method": "draft_model", "num_speculative_tokens": 3, "model": folder},
    )
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] == stats["spec_draft_tokens"]
