"""Structural tags for ``grammar_coverage.py``: a few dozen, built here from the JSON-schema
corpus, in both of vLLM's ``response_format`` shapes: xgrammar's ``format`` (a tree of
``triggered_tags``, ``tag``, ``sequence``, ``or``, ``const_string``, ``any_text``,
``json_schema``; a few with what only xgrammar reads: ``tags_with_separator``,
``at_least_one``, ``stop_after_first``, ``regex``, free text before the end) and vLLM's older
``structures`` (``begin``, ``schema``, ``end``) with ``triggers``. The JSON schemas inside
are the corpus's, chosen to include ones a backend refuses, so a tag's fate follows its
schemas' as well as its shape's."""

from __future__ import annotations

# schemas of the JSON corpus that go inside the tags: each backend compiles most, refuses some
INSIDE = (
    "person",
    "tool-call-args",
    "nested",
    "enum-strings",
    "ref-defs",
    "recursive-tree",
    "pattern",
    "format-date",
    "anyOf",
    "array-of-objects",
    "integer-bounds",
    "true-schema",
    "pattern-unicode-class",  # xgrammar refuses
    "min-max-properties",  # xgrammar refuses
    "contains",  # llguidance refuses
    "uniqueItems",  # both refuse
)
FUNCTIONS = ("get_weather", "search", "book_flight")


def json_content(schema) -> dict:
    return {"type": "json_schema", "json_schema": schema}


def tag(begin: str, content: dict, end: str | list[str]) -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def structural(fmt: dict) -> dict:
    return {"type": "structural_tag", "format": fmt}


def _format_tags(name: str, schema, other) -> dict[str, dict]:
    """The ``format`` shapes around one schema (``other``: a second schema for two-tool tags)."""
    function = tag(f"<function={FUNCTIONS[0]}>", json_content(schema), "</function>")
    hermes = [
        tag(f'<tool_call>{{"name": "{f}", "arguments": ', json_content(s), "}</tool_call>")
        for f, s in zip(FUNCTIONS, (schema, other, True))
    ]
    return {
        f"format/triggered-one/{name}": structural(
            {"type": "triggered_tags", "triggers": ["<function="], "tags": [function]}
        ),
        f"format/triggered-hermes/{name}": structural(
            {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": hermes}
        ),
        f"format/tag-alone/{name}": structural(tag("<answer>", json_content(schema), "</answer>")),
        f"format/sequence/{name}": structural(
            {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": "Result: "},
                    tag("<json>", json_content(schema), ["</json>", "</JSON>"]),
                    {"type": "any_text"},
                ],
            }
        ),
        f"format/or/{name}": structural(
            {"type": "or", "elements": [tag("<a>", json_content(schema), "</a>"), json_content(other)]}
        ),
    }


def _xgrammar_only(schema) -> dict[str, dict]:
    """Formats the grammar interface leaves optional: xgrammar reads them, llguidance refuses."""
    calls = [tag(f"<{f}>", json_content(schema), f"</{f}>") for f in FUNCTIONS[:2]]
    return {
        "format/tags-with-separator": structural(
            {"type": "tags_with_separator", "tags": calls, "separator": ", "}
        ),
        "format/triggered-at-least-one": structural(
            {"type": "triggered_tags", "triggers": ["<"], "tags": calls, "at_least_one": True}
        ),
        "format/triggered-stop-after-first": structural(
            {"type": "triggered_tags", "triggers": ["<"], "tags": calls, "stop_after_first": True}
        ),
        "format/regex-content": structural(
            tag("<id>", {"type": "regex", "pattern": "[a-z]{3}-[0-9]{4}"}, "</id>")
        ),
        "format/any-text-not-last": structural(
            {
                "type": "sequence",
                "elements": [{"type": "any_text"}, tag("<end>", json_content(schema), "</end>")],
            }
        ),
    }


def _legacy_tags(name: str, schema, other) -> dict[str, dict]:
    """vLLM's older shape: ``structures`` of begin/schema/end and ``triggers`` (its schemas are
    objects: ``true`` becomes ``{}``)."""
    schema, other = (s if isinstance(s, dict) else {} for s in (schema, other))
    one = [{"begin": f"<function={FUNCTIONS[0]}>", "schema": schema, "end": "</function>"}]
    several = [
        {"begin": f"<function={f}>", "schema": s, "end": "</function>"}
        for f, s in zip(FUNCTIONS, (schema, other, schema))
    ]
    return {
        f"structures/one/{name}": {"type": "structural_tag", "structures": one, "triggers": ["<function="]},
        f"structures/several/{name}": {
            "type": "structural_tag",
            "structures": several,
            "triggers": ["<function="],
        },
    }


def structural_tags(schemas: dict) -> dict[str, dict]:
    """name -> a ``response_format`` of type ``structural_tag``, in either of vLLM's shapes."""
    inside = [(name, schemas[name]) for name in INSIDE]
    tags: dict[str, dict] = {}
    for i, (name, schema) in enumerate(inside):
        other = inside[(i + 1) % len(inside)][1]
        formats = _format_tags(name, schema, other)
        shape = list(formats)[i % len(formats)]  # one format shape per schema, in turn
        tags[shape] = formats[shape]
        if i % 3 == 0:  # and a second, so each shape meets several schemas
            second = list(formats)[(i + 2) % len(formats)]
            tags[second] = formats[second]
        legacy = _legacy_tags(name, schema, other)
        tags.update(legacy if i % 2 == 0 else dict(list(legacy.items())[:1]))
    tags.update(_xgrammar_only(schemas["person"]))
    return tags
