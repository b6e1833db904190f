"""xgrammar behind the GrammarBackend interface.

The tokenizer's vocabulary info is built once per (tokenizer, vocab size) and shared by
every backend instance; compiled grammars are cached by spec (an LRU of
``CACHE_SIZE``), so ``n > 1`` children and repeated schemas compile once. JSON (``json``
and ``json_object``) is compiled in ``json.dumps``'s layout (``", "`` and ``": "``, no free
whitespace), which keeps sampled documents short and always terminating. xgrammar's bitmask
layout is the engine's, so ``fill_bitmask`` writes the row in place.
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict

import xgrammar as xgr

from engine.interfaces import Grammar, GrammarBackend, GrammarSpec

CACHE_SIZE = 256
ANY_OBJECT = '{"type": "object"}'  # any members: with no "properties", strict mode leaves it open
_infos: dict[tuple, xgr.TokenizerInfo] = {}
_infos_lock = threading.Lock()


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    key = (getattr(tokenizer, "name_or_path", ""), len(tokenizer), vocab_size, id(tokenizer))
    with _infos_lock:
        if key not in _infos:
            _infos[key] = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        return _infos[key]


class XGrammar(Grammar):
    def __init__(self, compiled: xgr.CompiledGrammar):
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for accepted, token in enumerate(token_ids):
            if not self.matcher.accept_token(token):
                if accepted:
                    self.matcher.rollback(accepted)
                return False
        return True

    def fill_bitmask(self, bitmask, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def reset(self) -> None:
        self.matcher.reset()


class XGrammarBackend(GrammarBackend):
    def __init__(self, ctx):
        super().__init__(ctx)
        if ctx.tokenizer is None:
            raise ValueError("structured outputs with xgrammar need the model's tokenizer")
        # half the cores at most: compilation must leave room for the step loop
        threads = max(1, (os.cpu_count() or 2) // 2)
        self.compiler = xgr.GrammarCompiler(
            tokenizer_info(ctx.tokenizer, ctx.vocab_size), max_threads=threads, cache_enabled=False
        )
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def supports(cls, spec: GrammarSpec) -> list[str]:
        kinds = ("json", "json_object", "regex", "grammar", "choice", "structural_tag")
        return (
            [] if spec.kind in kinds else [f"xgrammar does not compile {spec.kind!r} (it compiles {kinds})"]
        )

    def compile(self, spec: GrammarSpec) -> Grammar:
        key = json.dumps([spec.kind, spec.value], sort_keys=True)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = self._compile(spec)
            with self._lock:
                self._cache[key] = compiled
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return XGrammar(compiled)

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        try:
            if spec.kind == "json":
                schema = spec.value if isinstance(spec.value, str) else json.dumps(spec.value)
                try:
                    ignored = ignored_keywords(json.loads(schema))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"invalid json: the schema is not JSON ({exc})") from None
                if ignored:
                    raise ValueError(
                        f"invalid json: xgrammar would not enforce {', '.join(ignored)} "
                        "(its output could break the schema)"
                    )
                return self.compiler.compile_json_schema(schema, any_whitespace=False)
            if spec.kind == "json_object":  # an object, as OpenAI's; xgrammar's builtin JSON takes any value
                return self.compiler.compile_json_schema(ANY_OBJECT, any_whitespace=False)
            if spec.kind == "regex":
                return self.compiler.compile_regex(spec.value)
            if spec.kind == "grammar":
                return self.compiler.compile_grammar(spec.value)
            if spec.kind == "structural_tag":
                return self._structural_tag(spec.value)
            choices = list(spec.value)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice needs a non-empty list of non-empty strings")
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
        except (RuntimeError, TypeError) as exc:  # xgrammar reports bad specs as RuntimeError
            raise ValueError(f"invalid {spec.kind}: {_first_line(exc)}") from None

    def _structural_tag(self, tag) -> xgr.CompiledGrammar:
        """xgrammar's own structural tags; its JSON schemas checked for keywords it would not
        enforce, as the ``json`` kind's are, and compiled in the ``json`` kind's layout."""
        if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
            raise ValueError('invalid structural_tag: it is {"type": "structural_tag", "format": {...}}')  # noqa: TRY004 - the interface says ValueError
        ignored = sorted({k for schema in tag_schemas(tag["format"]) for k in ignored_keywords(schema)})
        if ignored:
            raise ValueError(f"invalid structural_tag: xgrammar would not enforce {', '.join(ignored)}")
        try:
            laid_out = {**tag, "format": dumps_layout(tag["format"])}
            return self.compiler.compile_structural_tag(json.dumps(laid_out))
        except ValueError as exc:  # pydantic's validation of the format
            raise ValueError(f"invalid structural_tag: {_first_line(exc)}") from None


def dumps_layout(node):
    """``node`` (a structural tag's format) with each JSON-style ``json_schema`` as the
    grammar of that schema in ``json.dumps``'s layout: xgrammar's structural tags allow free
    whitespace in JSON, where a sampled document can run on in whitespace to the token limit."""
    if isinstance(node, list):
        return [dumps_layout(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" and not node.get("excludes"):
        schema = node.get("json_schema")
        text = json.dumps({} if schema is True else schema)
        return {"type": "grammar", "grammar": str(xgr.Grammar.from_json_schema(text, any_whitespace=False))}
    return {key: dumps_layout(value) for key, value in node.items()}


def tag_schemas(node):
    """Every ``json_schema`` of a structural tag's format, nested ones included."""
    if isinstance(node, list):
        for item in node:
            yield from tag_schemas(item)
    elif isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield node["json_schema"]
        for value in node.values():
            if isinstance(value, dict | list):
                yield from tag_schemas(value)


# keywords xgrammar 0.2.9 compiles without enforcing them (its grammars accept [1, 1] under
# uniqueItems, "a" under {"not": {"type": "string"}}, 0.3 under multipleOf 0.5 ...)
IGNORED = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "contains", "propertyNames")


def ignored_keywords(schema) -> list[str]:
    """The keywords of ``schema`` and its subschemas that xgrammar would silently not enforce
    (a grammar looser than the schema, which the interface forbids), sorted; ``[]``: none."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):  # draft-4 tuple items
            stack += node
        if not isinstance(node, dict):
            continue
        found.update(k for k in IGNORED if k in node)
        if node.get("uniqueItems") is True:
            found.add("uniqueItems")
        if "multipleOf" in node and node.get("type") != "integer":
            found.add("multipleOf (on non-integers)")
        stack += [
            sub for key in SUBSCHEMA_MAPS if isinstance(node.get(key), dict) for sub in node[key].values()
        ]
        stack += [sub for key in SUBSCHEMA_LISTS if isinstance(node.get(key), list) for sub in node[key]]
        stack += [node[key] for key in SUBSCHEMAS if key in node]
    return sorted(found)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
    text = text.split(": ", 1)[-1] if text.startswith("[") else text
    return text.split(" is false: ", 1)[-1]  # xgrammar's "Check failed: (...) is false: <why>"
