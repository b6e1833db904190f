"""Suffix drafting: each request keeps a suffix automaton of its tokens (extended as tokens
arrive); optionally, a shared corpus automaton holds the sequences of finished requests.
The longest earlier match of the request's current suffix, in either, proposes the tokens
that followed it; the longer the match, the more tokens are proposed
(``match_len * draft_ratio``, at most ``num_speculative_tokens``; nothing below
``min_match``)."""

from __future__ import annotations

from engine.interfaces import Draft, Drafter
from engine_spec_suffix.automaton import SuffixAutomaton

SEPARATOR = -1  # between corpus documents; no token id equals it


class SuffixDrafter(Drafter):
    def __init__(self, ctx):
        super().__init__(ctx)
        cfg = self.method_config
        self.min_match = int(cfg.get("min_match", 2))
        self.draft_ratio = float(cfg.get("draft_ratio", 1.0))
        self.max_corpus_tokens = int(cfg.get("max_corpus_tokens", 200_000))
        self.corpus = SuffixAutomaton() if cfg.get("corpus", False) else None
        self.window = int(cfg.get("corpus_match_window", 64))
        self._requests: dict[str, SuffixAutomaton] = {}

    def propose(self, requests):
        return [Draft(self._draft(r.request_id, r.token_ids, r.max_tokens)) for r in requests]

    def _draft(self, request_id: str, tokens, max_tokens: int) -> list[int]:
        automaton = self._requests.setdefault(request_id, SuffixAutomaton())
        for token in tokens[len(automaton.tokens) :]:
            automaton.extend(token)
        length, end = automaton.earlier_match()
        source = automaton.tokens
        if self.corpus is not None and self.corpus.tokens:
            corpus_length, corpus_end = self.corpus.match(list(tokens[-self.window :]))
            if corpus_length > length:
                length, end, source = corpus_length, corpus_end, self.corpus.tokens
        if length < self.min_match:
            return []
        count = min(max_tokens, max(1, int(length * self.draft_ratio)))
        return [t for t in source[end + 1 : end + 1 + count] if t != SEPARATOR][:count]

    def finished(self, request_ids) -> None:
        for rid in request_ids:
            automaton = self._requests.pop(rid, None)
            if automaton is None or self.corpus is None:
                continue
            if len(self.corpus.tokens) + len(automaton.tokens) < self.max_corpus_tokens:
                for token in automaton.tokens:
                    self.corpus.extend(token)
                self.corpus.extend(SEPARATOR)
