"""Structural tags as vLLM takes them (``response_format`` of type ``structural_tag``, or
``structured_outputs.structural_tag`` as its JSON text), checked and turned into the
grammar interface's ``structural_tag`` kind: xgrammar's ``{"type": "structural_tag",
"format": {...}}``. vLLM's older form, ``structures`` (``begin``, ``schema``, ``end``) and
``triggers``, is the format ``triggered_tags``: free text until a trigger, then a tag whose
begin it opens, its JSON and its end, then free text again."""

from __future__ import annotations

from engine.interfaces import GrammarSpec
from engine_server.errors import bad_request
from engine_server.validation import check_json_schema, parse_json_text


def structural_tag_spec(value, param: str, where: str) -> GrammarSpec:
    """``value``: the structural tag (an object or its JSON text); 400s name ``where``."""
    tag = parse_json_text(value, param) if isinstance(value, str) else value
    if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
        raise bad_request(f'{where} must be an object of type "structural_tag"', param)
    if "format" in tag:
        return GrammarSpec("structural_tag", {"type": "structural_tag", "format": _format(tag, param, where)})
    if "structures" in tag:
        return GrammarSpec("structural_tag", {"type": "structural_tag", "format": _legacy(tag, param, where)})
    raise bad_request(f"{where} needs a `format`, or `structures` and `triggers`", param)


def _format(tag: dict, param: str, where: str) -> dict:
    """The newer form's format; its JSON schemas are checked here, the rest by the backend."""
    fmt = tag["format"]
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request(f"{where}.format must be an object with a `type`", param)
    stack: list = [fmt]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and node.get("json_schema") is not True:
                check_json_schema(node.get("json_schema"), param, f"{where}.format's json_schema")
                continue
            stack += node.values()
        elif isinstance(node, list):
            stack += node
    return fmt


def _legacy(tag: dict, param: str, where: str) -> dict:
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise bad_request(f"{where}.triggers must be a non-empty list of non-empty strings", param)
    if not isinstance(structures, list) or not structures:
        raise bad_request(f"{where}.structures must be a non-empty list", param)
    tags = []
    for i, structure in enumerate(structures):
        at = f"{where}.structures[{i}]"
        if not isinstance(structure, dict):
            raise bad_request(f"{at} must be an object with begin, schema and end", param)
        begin, end = structure.get("begin"), structure.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise bad_request(f"{at}.begin and {at}.end must be strings", param)
        if not any(begin.startswith(trigger) for trigger in triggers):
            raise bad_request(f"{at}.begin {begin!r} starts with none of the triggers", param)
        schema = structure.get("schema")
        schema = True if schema is None else check_json_schema(schema, param, f"{at}.schema")
        tags.append(
            {
                "type": "tag",
                "begin": begin,
                "content": {"type": "json_schema", "json_schema": schema},
                "end": end,
            }
        )
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}
