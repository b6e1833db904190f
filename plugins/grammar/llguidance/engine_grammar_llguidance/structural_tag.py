"""xgrammar's structural tags (the ``structural_tag`` kind) as one llguidance Lark grammar.

Each format becomes a rule. ``triggered_tags`` follows llguidance's own recipe for tool calls
(``llguidance.StructTag``): free text is one lexeme, and each trigger is a *lazy* lexeme
(the text up to the first occurrence of the trigger), after which the tag's begin, content
and end are forced; then free text again. Free text must be able to stop where something
follows it, so ``any_text`` and ``triggered_tags`` are read at the end of the output (the
last of the top-level ``sequence``) or, for ``any_text``, as a tag's whole content (a lazy
lexeme up to the tag's end). ``json_schema`` is llguidance's JSON in ``json.dumps``'s layout.
"""

from __future__ import annotations

import json

FREE_TEXT = r"/(.|\n)*/"
FORMATS = ("const_string", "json_schema", "any_text", "sequence", "or", "tag", "triggered_tags")
DEFAULTS = {"at_least_one": False, "stop_after_first": False, "excludes": []}


def unsupported(tag) -> list[str]:
    """Why this translation cannot read ``tag`` (empty: it can); shape errors are left to compile."""
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        return []
    reasons: list[str] = []
    _check(tag["format"], at_end=True, reasons=reasons)
    return reasons


def _check(node, at_end: bool, reasons: list[str], in_tag: bool = False) -> None:
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    where = f"llguidance does not read structural tag format {kind!r}"
    if kind not in FORMATS:
        reasons.append(f"{where} (it reads {', '.join(FORMATS)})")
    elif kind == "json_schema" and node.get("style", "json") != "json":
        reasons.append(f"llguidance reads json_schema in the json style only, not {node['style']!r}")
    elif kind in ("any_text", "triggered_tags") and not (at_end or (in_tag and kind == "any_text")):
        reasons.append(f"llguidance reads {kind} only at the end of the output or as a tag's content")
    elif any(node.get(key, value) != value for key, value in DEFAULTS.items()) or node.get("excludes"):
        reasons.append(f"llguidance reads {kind} without at_least_one, stop_after_first or excludes")
    elif kind == "tag" and not all(isinstance(node.get(k), str | list) for k in ("begin", "end")):
        reasons.append("llguidance reads tags with string begin and end only")
    elements = node.get("elements") if kind in ("sequence", "or") else None
    for i, element in enumerate(elements if isinstance(elements, list) else []):
        _check(element, at_end and (kind == "or" or i == len(elements) - 1), reasons)
    if kind == "tag":
        _check(node.get("content"), False, reasons, in_tag=True)
    for tag in node.get("tags") or [] if kind == "triggered_tags" else []:
        _check(tag, False, reasons)


def to_lark(tag, json_layout: dict) -> str:
    """``tag`` as a Lark grammar, its JSON in ``json_layout`` (llguidance's ``x-guidance``
    options); ValueError for a malformed one."""
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise ValueError('a structural tag is {"type": "structural_tag", "format": {...}}')  # noqa: TRY004 - the interface says ValueError
    reasons = unsupported(tag)
    if reasons:
        raise ValueError("; ".join(reasons))
    rules: list[str] = []
    start = _LarkWriter(rules, json_layout).rule(tag["format"])
    return "%llguidance {}\n" + f"start: {start}\n" + "\n".join(rules) + "\n"


class _LarkWriter:
    def __init__(self, rules: list[str], json_layout: dict):
        self.rules, self.json_layout = rules, json_layout

    def rule(self, node) -> str:
        """A new rule matching ``node``; its name."""
        if not isinstance(node, dict):
            raise ValueError(f"a structural tag format is an object, not {node!r}")  # noqa: TRY004 - the interface says ValueError
        name = f"r{len(self.rules)}"
        self.rules.append("")  # reserved: nested rules come after it
        self.rules[int(name[1:])] = f"{name}: {self.body(node, name)}"
        return name

    def body(self, node: dict, name: str) -> str:
        kind = node.get("type")
        if kind == "const_string":
            return _literal(_field(node, "value", str))
        if kind == "json_schema":
            return "%json " + json.dumps(self.json_schema(node.get("json_schema")))
        if kind == "any_text":
            return name.upper() + f"\n{name.upper()}: {FREE_TEXT}"
        if kind in ("sequence", "or"):
            elements = _field(node, "elements", list)
            if not elements:
                raise ValueError(f"{kind} needs elements")
            return (" " if kind == "sequence" else " | ").join(self.rule(e) for e in elements)
        if kind == "tag":
            return self.tag(node, _field(node, "begin", str))
        return self.triggered(node, name)

    def tag(self, node: dict, begin: str) -> str:
        """``begin`` (what is left of the tag's begin), the content, one of the ends."""
        ends = node.get("end")
        ends = [ends] if isinstance(ends, str) else ends
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise ValueError("a tag's end is a string or a list of strings")
        content = node.get("content")
        end = " | ".join(_literal(e) for e in ends)
        if isinstance(content, dict) and content.get("type") == "any_text":  # free text up to the end
            lexeme = f"T{len(self.rules)}"
            self.rules.append(f"{lexeme.lower()}[lazy]: {FREE_TEXT} ({end})")
            return f"{_literal(begin)} {lexeme.lower()}"
        return f"{_literal(begin)} {self.rule(content)} ({end})"

    def triggered(self, node: dict, name: str) -> str:
        triggers, tags = _field(node, "triggers", list), _field(node, "tags", list)
        if not triggers or not all(isinstance(t, str) and t for t in triggers):
            raise ValueError("triggered_tags needs non-empty trigger strings")
        text = f"{name.upper()}_TEXT"
        self.rules.append(f"{text}: {FREE_TEXT}")
        alternatives = []
        for i, trigger in enumerate(triggers):
            mine = [t for t in tags if isinstance(t, dict) and str(t.get("begin", "")).startswith(trigger)]
            if not mine:
                raise ValueError(f"no tag's begin starts with trigger {trigger!r}")
            trig = f"{name}_t{i}"
            self.rules.append(f"{trig}[lazy]: {text} {_literal(trigger)}")
            bodies = " | ".join(f"({self.tag(t, t['begin'][len(trigger) :])})" for t in mine)
            alternatives.append(f"{trig} ({bodies})")
        if any(not any(str(t.get("begin", "")).startswith(x) for x in triggers) for t in tags):
            raise ValueError("a tag's begin starts with none of the triggers")
        return f"({' | '.join(alternatives)})* {text}"

    def json_schema(self, schema) -> dict:
        """The schema with the layout options."""
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema is a JSON Schema object, not {schema!r}")  # noqa: TRY004 - the interface says ValueError
        return {**schema, "x-guidance": self.json_layout}


def _field(node: dict, key: str, kind: type):
    value = node.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"{node.get('type')}.{key} must be a {kind.__name__}")  # noqa: TRY004 - the interface says ValueError
    return value


def _literal(text: str) -> str:
    return json.dumps(text) if text else '""'
