"""The structured-output constraint of a request, from OpenAI's ``response_format`` or vLLM's
``structured_outputs`` / ``guided_*`` fields, type-checked here (a JSON schema against its
meta-schema) so only well-formed specs reach the engine's grammar compiler."""

from __future__ import annotations

from engine.interfaces import GrammarSpec
from engine_server.errors import bad_request
from engine_server.structural_tags import structural_tag_spec
from engine_server.validation import check_json_schema, parse_json_text

KINDS = ("json", "regex", "choice", "grammar")


def structured_spec(body, chat: bool) -> GrammarSpec | None:
    """One constraint at most; more than one is a 400 naming the second."""
    found: list[tuple[str, GrammarSpec]] = []
    response_format = body.response_format if chat else None
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            found.append(("response_format", spec))
    outputs = body.structured_outputs or {}
    for key in outputs:
        if key not in (*KINDS, "json_object", "structural_tag"):
            raise bad_request(
                f"structured_outputs.{key} is not one of {', '.join(KINDS)}, json_object, structural_tag",
                "structured_outputs",
            )
    if outputs.get("structural_tag") is not None:
        tag = structural_tag_spec(
            outputs["structural_tag"], "structured_outputs", "structured_outputs.structural_tag"
        )
        found.append(("structured_outputs", tag))
    for kind in KINDS:
        if kind in outputs:
            value, param, where = outputs[kind], "structured_outputs", f"structured_outputs.{kind}"
        else:
            value = getattr(body, f"guided_{kind}")
            param = where = f"guided_{kind}"
        if value is not None:
            found.append((param, GrammarSpec(kind, _checked(kind, value, param, where))))
    json_object = outputs.get("json_object")
    if not isinstance(json_object, bool | None):
        raise bad_request("structured_outputs.json_object must be a boolean", "structured_outputs")
    if json_object:
        found.append(("structured_outputs", GrammarSpec("json_object", None)))
    if len(found) > 1:
        raise bad_request(
            f"give one structured-output constraint, not {len(found)}: "
            f"{', '.join(name for name, _ in found)}",
            found[1][0],
        )
    return found[0][1] if found else None


def _response_format(response_format: dict) -> GrammarSpec | None:
    kind = response_format.get("type")
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        if not isinstance(json_schema, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a `schema`", "response_format"
            )
        schema = check_json_schema(
            json_schema.get("schema"), "response_format", "response_format.json_schema.schema"
        )
        return GrammarSpec("json", schema)
    if kind == "json_object":
        return GrammarSpec("json_object", None)
    if kind == "structural_tag":
        return structural_tag_spec(response_format, "response_format", "response_format")
    if kind != "text":
        raise bad_request(
            f"response_format.type must be text, json_object, json_schema or structural_tag; got {kind!r}",
            "response_format",
        )
    return None


def _checked(kind: str, value, param: str, where: str):
    if kind == "json":
        schema = parse_json_text(value, param) if isinstance(value, str) else value
        return check_json_schema(schema, param, where)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise bad_request(f"{where} must be a non-empty list of non-empty strings", param)
        return value
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} must be a non-empty string", param)
    return value
