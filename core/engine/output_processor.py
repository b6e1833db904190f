"""Turns the engine core's token outputs into ``RequestOutput`` objects: text, stop
strings, logprob dicts with decoded tokens, and the fan-in of ``n > 1`` children."""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.step import EngineOutput, TokenLogprobs


class _Child:
    def __init__(self, index: int, tokenizer, params):
        self.index = index
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, params)
        self.token_ids: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative = 0.0 if params.logprobs is not None else None
        self.finish_reason = self.stop_reason = None
        self.num_draft_tokens = self.num_accepted_tokens = 0


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._parents: dict[str, RequestOutput] = {}
        self._children: dict[str, tuple[str, _Child]] = {}

    def add(self, parent_id: str, prompt: str | None, prompt_ids: list[int], child_ids: list[str], params):
        wants_prompt_logprobs = params.prompt_logprobs is not None
        self._parents[parent_id] = RequestOutput(parent_id, prompt, prompt_ids,
                                                 [None] if wants_prompt_logprobs else None, [], False)
        for index, cid in enumerate(child_ids):
            self._children[cid] = (parent_id, _Child(index, self.tokenizer, params))

    def process(self, outputs: list[EngineOutput]) -> tuple[list[RequestOutput], list[str]]:
        """-> (parents that finished, child ids the core must abort: they hit a stop string)."""
        to_abort, touched = [], set()
        for out in outputs:
            if out.request_id not in self._children:
                continue
            parent_id, child = self._children[out.request_id]
            parent = self._parents[parent_id]
            touched.add(parent_id)
            parent.num_cached_tokens = out.num_cached_tokens
            child.num_draft_tokens, child.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
            if out.new_prompt_logprobs and child.index == 0:
                parent.prompt_logprobs += [self._logprob_dict(e) for e in out.new_prompt_logprobs]
            self._append(child, out)
            if child.detok.stop_string is not None and not out.finished:
                child.finish_reason, child.stop_reason = "stop", child.detok.stop_string
                to_abort.append(out.request_id)
            elif out.finished and child.finish_reason is None:
                # an "error" finish carries its message as the stop reason
                child.finish_reason, child.stop_reason = out.finish_reason, out.error or out.stop_reason
        return [self._complete(pid) for pid in touched if self._all_done(pid)], to_abort

    def text_so_far(self, child_id: str) -> str:
        """Streamable text: what cannot still turn into a stop string."""
        _, child = self._children[child_id]
        text = child.detok.text
        return text[:max(0, len(text) - child.detok.pending_hold)]

    def _append(self, child: _Child, out: EngineOutput) -> None:
        if child.finish_reason is not None:
            return
        for i, token in enumerate(out.new_token_ids):
            child.token_ids.append(token)
            if child.logprobs is not None and out.new_logprobs:
                entry = out.new_logprobs[i]
                child.logprobs.append(self._logprob_dict(entry))
                child.cumulative += entry.logprobs[0]
            if child.detok.push([token]) is not None:
                break

    def _logprob_dict(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        return {t: Logprob(lp, rank, decode(t)) for t, lp, rank in zip(entry.token_ids, entry.logprobs, entry.ranks)}

    def _all_done(self, parent_id: str) -> bool:
        return all(c.finish_reason is not None for p, c in self._children.values() if p == parent_id)

    def _complete(self, parent_id: str) -> RequestOutput:
        parent = self._parents.pop(parent_id)
        children = sorted((c for p, c in self._children.values() if p == parent_id), key=lambda c: c.index)
        self._children = {k: v for k, v in self._children.items() if v[0] != parent_id}
        for c in children:
            text = c.detok.text
            if c.detok.stop_string is None and self.tokenizer is not None:
                text = self.tokenizer.decode(c.token_ids, skip_special_tokens=c.params.skip_special_tokens)
            parent.outputs.append(CompletionOutput(c.index, text, c.token_ids, c.cumulative, c.logprobs,
                                                   c.finish_reason, c.stop_reason, c.num_draft_tokens,
                                                   c.num_accepted_tokens))
        parent.finished = True
        return parent
