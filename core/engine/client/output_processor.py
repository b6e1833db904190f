"""A front end's side of its requests (one for ``LLM`` and the server): each prompt fanned out
into its samples' engine requests, each step's deltas fed to their :class:`SequenceOutput`,
the samples that hit a stop string listed for abort (the core knows no stop strings), and a
prompt whose samples all finished handed back; :func:`request_output` makes ``LLM``'s
:class:`~engine.messages.outputs.RequestOutput` of it."""

from __future__ import annotations

from engine.client.base import Child
from engine.client.protocol import Delta
from engine.client.sequence import SequenceOutput
from engine.messages.outputs import CompletionOutput, Logprob, RequestOutput
from engine.messages.request_path import fan_out
from engine.messages.sampling_params import SamplingParams


class RequestState:
    """One prompt and its samples (vLLM's parent request)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]):
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.sequences: list[SequenceOutput] = []
        self.prompt_logprobs: list[tuple] = []  # entries of prompt positions 1.., from its first sample
        self.unfinished = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.to_abort: list[str] = []  # sequences that hit a stop string while the core runs them
        self.finished: list[RequestState] = []  # prompts whose samples all finished
        self._sequences: dict[str, SequenceOutput] = {}  # the unfinished ones, by engine request id

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        first_index: int = 0,
    ) -> tuple[RequestState, list[Child]]:
        """The prompt's state, and its samples (:func:`fan_out`) as the engine requests to add;
        the samples are numbered from ``first_index``."""
        state = RequestState(request_id, prompt, prompt_token_ids)
        children = fan_out(request_id, params)
        for offset, (child_id, child_params) in enumerate(children):
            sequence = SequenceOutput(child_id, first_index + offset, self.tokenizer, child_params, state)
            state.sequences.append(sequence)
            self._sequences[child_id] = sequence
        state.unfinished = len(children)
        return state, [(child_id, prompt_token_ids, child_params) for child_id, child_params in children]

    def feed(self, delta: Delta) -> tuple[SequenceOutput, str, list[tuple]] | None:
        """The delta's sequence, with its text now safe to hand out and its new logprob entries
        (None: not a sequence of ours, or one that finished already)."""
        sequence = self._sequences.get(delta.request_id)
        if sequence is None:
            return None
        if delta.prompt_logprobs:
            sequence.request.prompt_logprobs += delta.prompt_logprobs
        text, entries = sequence.feed(delta)
        if sequence.finish_reason is not None:
            if delta.finish_reason is None:
                self.to_abort.append(sequence.request_id)
            del self._sequences[sequence.request_id]
            sequence.request.unfinished -= 1
            if not sequence.request.unfinished:
                self.finished.append(sequence.request)
        return sequence, text, entries

    def take_aborts(self) -> list[str]:
        aborts = self.to_abort
        if aborts:  # most calls find none: no new list for them
            self.to_abort = []
        return aborts

    def take_finished(self) -> list[RequestState]:
        finished = self.finished
        if finished:
            self.finished = []
        return finished


def request_output(state: RequestState, tokenizer) -> RequestOutput:
    """``LLM``'s result of a finished prompt: each sample's whole text decoded anew (unless a
    stop string cut it), its logprobs as dicts with decoded tokens, and the prompt's."""
    first = state.sequences[0]
    prompt_logprobs = None
    if first.params.prompt_logprobs is not None:
        prompt_logprobs = [None] + [_logprob_dict(e, tokenizer) for e in state.prompt_logprobs]
    return RequestOutput(
        state.request_id,
        state.prompt,
        state.prompt_token_ids,
        prompt_logprobs,
        [_completion(s, tokenizer) for s in state.sequences],
        True,
        first.num_cached_tokens,
    )


def _completion(sequence: SequenceOutput, tokenizer) -> CompletionOutput:
    text = sequence.text
    if not sequence.hit_stop_string and tokenizer is not None:
        text = tokenizer.decode(sequence.token_ids, skip_special_tokens=sequence.params.skip_special_tokens)
    logprobs = cumulative = None
    if sequence.params.logprobs is not None:
        logprobs = [_logprob_dict(e, tokenizer) for e in sequence.logprobs]
        cumulative = sum((lps[0] for _, lps, _ in sequence.logprobs), 0.0)
    return CompletionOutput(
        sequence.index,
        text,
        sequence.token_ids,
        cumulative,
        logprobs,
        sequence.finish_reason,
        sequence.stop_reason,
        sequence.num_draft_tokens,
        sequence.num_accepted_tokens,
    )


def _logprob_dict(entry: tuple, tokenizer) -> dict[int, Logprob]:
    ids, logprobs, ranks = entry
    return {
        t: Logprob(lp, rank, None if tokenizer is None else tokenizer.decode([t]))
        for t, lp, rank in zip(ids, logprobs, ranks)
    }
