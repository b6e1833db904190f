"""An online suffix automaton over token ids. Each state remembers where its strings first
ended, so for any substring the tokens that followed its first occurrence are known."""

from __future__ import annotations


class SuffixAutomaton:
    def __init__(self):
        self.next: list[dict[int, int]] = [{}]
        self.link = [-1]
        self.length = [0]
        self.first_end = [-1]
        self.last = 0
        self.tokens: list[int] = []

    def _state(self, length: int, link: int, first_end: int, transitions: dict[int, int]) -> int:
        self.next.append(transitions)
        self.length.append(length)
        self.link.append(link)
        self.first_end.append(first_end)
        return len(self.length) - 1

    def extend(self, token: int) -> None:
        position = len(self.tokens)
        self.tokens.append(token)
        current = self._state(self.length[self.last] + 1, 0, position, {})
        p = self.last
        while p != -1 and token not in self.next[p]:
            self.next[p][token] = current
            p = self.link[p]
        if p != -1:
            q = self.next[p][token]
            if self.length[p] + 1 == self.length[q]:
                self.link[current] = q
            else:
                clone = self._state(self.length[p] + 1, self.link[q], self.first_end[q], dict(self.next[q]))
                while p != -1 and self.next[p].get(token) == q:
                    self.next[p][token] = clone
                    p = self.link[p]
                self.link[q] = self.link[current] = clone
        self.last = current

    def earlier_match(self) -> tuple[int, int]:
        """The longest suffix of the whole sequence that also ended earlier:
        (its length, where its first occurrence ended); (0, -1) if none."""
        end = len(self.tokens) - 1
        state = self.link[self.last]
        while state > 0 and self.first_end[state] >= end:
            state = self.link[state]
        return (self.length[state], self.first_end[state]) if state > 0 else (0, -1)

    def match(self, pattern: list[int]) -> tuple[int, int]:
        """The longest suffix of ``pattern`` that occurs here: (its length, where its first
        occurrence ended)."""
        state, length = 0, 0
        for token in pattern:
            while state and token not in self.next[state]:
                state = self.link[state]
                length = self.length[state]
            if token in self.next[state]:
                state, length = self.next[state][token], length + 1
        return (length, self.first_end[state]) if length else (0, -1)
