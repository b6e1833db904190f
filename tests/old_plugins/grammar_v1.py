"""A grammar backend as written against interface v1 (release 1), frozen: choice lists on a token
trie in plain Python, from the v1 docstrings alone. Those said how the bitmask is laid out (rows
of ``ceil(vocab / 32)`` int32 words covering ``ctx.vocab_size``), that ``fill_bitmask`` writes
the row and that a refused token changes nothing; they said nothing of EOS, ``is_terminated`` or
``reset``. So, as a v1 author would, it never allows EOS and is terminated as soon as the tokens
spell a whole choice: of the choices "deep" and "deep blue sea" it can only ever give "deep".
Today's contract (EOS allowed where the output may end, terminated only once EOS is accepted)
fails it; the engine must refuse it or adapt it, never run it silently."""

from engine import hookimpl
from engine.interfaces import Grammar, GrammarBackend, GrammarSpec


@hookimpl
def register_grammar_backends(register):
    register("choice-v1", ChoiceBackend, api=1)


class ChoiceGrammar(Grammar):
    def __init__(self, choices: list[list[int]]):
        self.choices = choices
        self.tokens: list[int] = []

    def _next(self) -> set[int]:
        n = len(self.tokens)
        return {c[n] for c in self.choices if len(c) > n and c[:n] == self.tokens}

    def accept_tokens(self, token_ids):
        for count, token in enumerate(token_ids):
            if token not in self._next():
                del self.tokens[len(self.tokens) - count :]
                return False
            self.tokens.append(token)
        return True

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for token in self._next():
            word, bit = divmod(token, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign

    def rollback(self, num_tokens):
        del self.tokens[len(self.tokens) - num_tokens :]

    def is_terminated(self):
        return self.tokens in self.choices

    def reset(self):
        self.tokens = []


class ChoiceBackend(GrammarBackend):
    @classmethod
    def supports(cls, spec: GrammarSpec) -> list[str]:
        return [] if spec.kind == "choice" else [f"choice-v1 compiles choice lists only, not {spec.kind}"]

    def compile(self, spec: GrammarSpec) -> Grammar:
        choices = list(spec.value)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("choice needs a non-empty list of non-empty strings")
        return ChoiceGrammar([self.ctx.tokenizer.encode(c, add_special_tokens=False) for c in choices])
