"""grammar-xgrammar: structured outputs compiled by xgrammar."""

from engine import hookimpl


@hookimpl
def register_grammar_backends(register):
    register("xgrammar", "engine_grammar_xgrammar.backend:XGrammarBackend", api=3)
