"""Drafter contract: speculation never changes greedy output. A tiny random Llama (saved as
a real checkpoint; its greedy continuations repeat, which gives lookup drafters matches)
generates a batch of mixed prompts under continuous batching, chunked prefill and a pool
small enough to preempt, with and without the drafter; the tokens must be identical, also
with repetition and frequency penalties and min_tokens, whose verification rows must count
the drafts before them.

Verification is exact, so a drafter that breaks its interface rarely shows in the output:
the engine cuts an overlong draft to the room it granted and pairs drafts with requests by
position. The kit checks every ``propose`` call of the greedy run against :data:`RULES`."""

from __future__ import annotations

import json

import pytest

from engine.testing import reference

TINY = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=True,
)
LENGTHS = [5, 30, 12, 44, 8, 21, 3, 17]
# shared_step_target_s=0: chunk sizes from the token budget alone, not from measured step times,
# so two runs schedule alike however loaded the machine is (a seeded request's draws follow
# its schedule: how many drafts each step verified)
OPTIONS = dict(
    dtype="float32",
    block_size=8,
    num_blocks=36,
    max_num_batched_tokens=32,
    max_num_seqs=6,
    max_model_len=160,
    shared_step_target_s=0,
)


# what every propose call keeps: one Draft per request, in their order; at most the request's
# max_tokens (the lookahead the engine reserved KV slots for); token ids the target has
RULES = ("one-draft-per-request", "drafts-fit-their-room", "ids-in-the-vocabulary")
_PROPOSALS: dict[str, list[tuple[list[int], list]]] = {}  # run -> (each request's room, drafts) per call


def _breaches(rule: str, rooms: list[int], drafts: list) -> list[str]:
    """How one propose call (each request's room, the drafts returned) breaks ``rule``."""
    if rule == "one-draft-per-request":
        return [] if len(drafts) == len(rooms) else [f"{len(drafts)} drafts for {len(rooms)} requests"]
    tokens = [list(draft.token_ids) for draft in drafts]
    if rule == "drafts-fit-their-room":
        return [f"{len(t)} tokens for room for {room}" for room, t in zip(rooms, tokens) if len(t) > room]
    vocab = TINY["vocab_size"]
    return [f"draft {t} leaves [0, {vocab})" for t in tokens if not all(0 <= i < vocab for i in t)]


def _prompts():
    base = reference.random_prompts(TINY["vocab_size"], LENGTHS, seed=11)
    return [p + p[: len(p) // 2] for p in base]  # some self-repetition to look up


class DrafterContract:
    speculative_config: dict  # {"method": ..., "num_speculative_tokens": ...}; may use {model_dir}
    new_tokens = 24

    @pytest.fixture(scope="class")
    @classmethod
    def model_dir(cls, tmp_path_factory):
        folder = str(tmp_path_factory.mktemp("spec-target"))
        reference.tiny_checkpoint(folder, "LlamaForCausalLM", TINY, seed=5)
        return folder

    def config(self, model_dir: str) -> dict:
        return {
            k: (v.format(model_dir=model_dir) if isinstance(v, str) else v)
            for k, v in self.speculative_config.items()
        }

    def _generate(self, model_dir, params, record: list | None = None, **spec):
        """Tokens and stats of a run; with ``record``, each propose call's (rooms, drafts) too."""
        from engine import LLM

        llm = LLM(model_dir, **OPTIONS, **spec)
        if record is not None:
            drafter = llm.engine.speculator.drafter
            propose = drafter.propose

            def recording(requests):
                drafts = propose(requests)
                record.append(([r.max_tokens for r in requests], list(drafts)))
                return drafts

            drafter.propose = recording
        outs = llm.generate(_prompts(), params)
        return [o.outputs[0].token_ids for o in outs], llm.engine.stats()

    def _run_key(self, model_dir) -> str:
        return json.dumps([model_dir, self.config(model_dir)], sort_keys=True, default=str)

    @pytest.mark.parametrize("penalties", [False, True], ids=["plain", "penalties"])
    def test_greedy_output_is_unchanged(self, model_dir, penalties):
        from engine import SamplingParams

        extra = dict(repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=6) if penalties else {}
        params = SamplingParams(max_tokens=self.new_tokens, temperature=0, ignore_eos=True, **extra)
        expected, _ = self._generate(model_dir, params)
        record = [] if not penalties else None  # the plain run's calls serve the interface checks
        got, stats = self._generate(model_dir, params, record, speculative_config=self.config(model_dir))
        if record is not None:
            _PROPOSALS[self._run_key(model_dir)] = record
        assert got == expected
        assert stats["preemptions"] > 0, "the pool must be small enough to preempt"
        assert stats["spec_draft_tokens"] > 0, "the drafter proposed nothing"
        assert 0 <= stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]

    def test_seeded_sampling_runs_to_length(self, model_dir):
        from engine import SamplingParams

        params = SamplingParams(
            max_tokens=self.new_tokens, temperature=0.9, top_p=0.95, seed=3, ignore_eos=True
        )
        got, _ = self._generate(model_dir, params, speculative_config=self.config(model_dir))
        assert all(len(tokens) == self.new_tokens for tokens in got)
        again, _ = self._generate(model_dir, params, speculative_config=self.config(model_dir))
        assert got == again, "seeded requests must be reproducible with speculation too"

    @pytest.mark.parametrize("rule", RULES)
    def test_proposals_keep_the_interface(self, model_dir, rule):
        """Each propose call of the plain greedy run (recorded by its test, or run here)."""
        from engine import SamplingParams

        key = self._run_key(model_dir)
        if key not in _PROPOSALS:
            params = SamplingParams(max_tokens=self.new_tokens, temperature=0, ignore_eos=True)
            record = _PROPOSALS[key] = []
            self._generate(model_dir, params, record, speculative_config=self.config(model_dir))
        calls = _PROPOSALS[key]
        assert calls, "the drafter was never asked for drafts"
        breaches = [b for rooms, drafts in calls for b in _breaches(rule, rooms, drafts)]
        assert not breaches, f"{rule}: {len(breaches)} breaches in {len(calls)} calls, e.g. {breaches[:3]}"
