"""The ways an OpenAI-style request asks for constrained output, as one GuidedDecodingParams:

    response_format   {"type": "text"} | {"type": "json_object"} |
                      {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} |
                      vLLM's {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers"}
    vLLM's extras     guided_json, guided_regex, guided_grammar (Lark or GBNF), guided_choice,
                      and structured_outputs {"json" | "regex" | "grammar" | "choice" | "json_object" |
                      "structural_tag" (the JSON text of {"structures", "triggers"})}

At most one of them may constrain a request (response_format "text" constrains nothing). A schema's
validity is the grammar engine's to judge (Engine.validate refuses what it cannot compile)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxserve.host.request import GuidedDecodingParams

GUIDED_FIELDS = {  # vLLM's request field -> GuidedDecodingParams' field
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_grammar": "grammar",
    "guided_choice": "choice",
}
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "grammar", "choice", "json_object", "structural_tag")
STRUCTURED_OUTPUT_OPTIONS = ("whitespace_pattern",)  # vLLM's StructuredOutputsParams fields beside the kind
# vLLM lets a request pick its grammar backend; this server has one, so naming it (or none) is fine
GUIDED_BACKENDS = (None, "", "auto", "guidance", "llguidance")


def response_format_guide(response_format: Any) -> GuidedDecodingParams | None:
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format json_schema needs a 'json_schema' object with the schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:  # OpenAI allows a named format without a schema: any JSON object
            return GuidedDecodingParams(json_object=True)
        if not isinstance(schema, dict):
            raise ValueError(f"response_format.json_schema.schema must be a JSON schema object, got {schema!r}"[:200])
        return GuidedDecodingParams(json=schema)
    if kind == "structural_tag":  # vLLM's: its structures and triggers beside the type
        return GuidedDecodingParams(structural_tag={k: v for k, v in response_format.items() if k != "type"})
    raise ValueError(
        f"response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', got {kind!r}"
        if kind is not None
        else "response_format must be an object like {'type': 'json_object'}"
    )


def structured_outputs_guide(structured_outputs: Any) -> GuidedDecodingParams | None:
    if structured_outputs is None:
        return None
    if not isinstance(structured_outputs, dict):
        raise ValueError("structured_outputs must be an object like {'json': {...}} or {'regex': '...'}")
    allowed = STRUCTURED_OUTPUT_KINDS + STRUCTURED_OUTPUT_OPTIONS
    unknown = sorted(k for k, v in structured_outputs.items() if k not in allowed and v is not None)
    if unknown:
        raise ValueError(
            f"structured_outputs: {', '.join(unknown)} not supported (only {', '.join(STRUCTURED_OUTPUT_KINDS)})"
        )
    given = {k: v for k, v in structured_outputs.items() if v not in (None, False)}
    return guide(**given) if given else None


def guide(**spec) -> GuidedDecodingParams:
    """GuidedDecodingParams from one kind's value; ValueError naming a malformed one."""
    if "json" in spec and not isinstance(spec["json"], (dict, str)):
        raise ValueError("a guided JSON schema must be an object or its JSON text")
    if "structural_tag" in spec and not isinstance(spec["structural_tag"], (dict, str)):
        raise ValueError("structured_outputs.structural_tag must be an object or its JSON text")
    schema_text = spec.get("json")
    if isinstance(schema_text, str):
        try:
            parsed = json.loads(schema_text)
        except json.JSONDecodeError as error:
            raise ValueError(f"the guided JSON schema is not valid JSON: {error}") from None
        if not isinstance(parsed, dict):
            raise ValueError("a guided JSON schema must be a JSON object")
    if "json_object" in spec and spec["json_object"] is not True:
        raise ValueError("structured_outputs.json_object must be true")
    return GuidedDecodingParams(**spec)


def guided_decoding(request) -> GuidedDecodingParams | None:
    """The one constraint a request asks for (SamplingRequest's fields), or None; ValueError when it asks
    for two, or for one malformed."""
    found: list[tuple[str, GuidedDecodingParams]] = []
    if (params := response_format_guide(request.response_format)) is not None:
        found.append(("response_format", params))
    for field, kind in GUIDED_FIELDS.items():
        value = getattr(request, field)
        if value is not None:
            found.append((field, guide(**{kind: value})))
    if (params := structured_outputs_guide(request.structured_outputs)) is not None:
        found.append(("structured_outputs", params))
    if request.guided_decoding_backend not in GUIDED_BACKENDS:
        raise ValueError(
            f"guided_decoding_backend {request.guided_decoding_backend!r} is not available: this server uses llguidance"
        )
    if len(found) > 1:
        raise ValueError(f"{' and '.join(name for name, _ in found)} each constrain the output: give only one")
    if request.guided_whitespace_pattern is not None:  # vLLM's: the whitespace a JSON reply may hold
        if not found:
            raise ValueError("guided_whitespace_pattern needs a JSON constraint (guided_json, response_format...)")
        return dataclasses.replace(found[0][1], whitespace_pattern=request.guided_whitespace_pattern)
    return found[0][1] if found else None


def guide_text(params: GuidedDecodingParams | None) -> list[str]:
    """The spec's text, for the size cap."""
    if params is None:
        return []
    texts = [str(params.json or ""), params.regex or "", params.grammar or "", *(params.choice or ())]
    texts.append(str(params.structural_tag or ""))
    return [*texts, params.whitespace_pattern or ""]
