"""Check tool arguments against a tool's JSON Schema, with messages a model can act on.

Only the subset :mod:`hutch.agent_tools.specs` uses is supported (a test checks every schema
uses nothing else). Hand-written rather than ``jsonschema`` because the message is the
product here: it names the argument, what was wrong and what is accepted, and the
integrations must work without the ``mcp`` package's dependencies.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hutch.errors import InvalidArgument

__all__ = ["SUPPORTED_KEYWORDS", "check_arguments"]

SUPPORTED_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "maxItems",
        "enum",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "pattern",
        "default",
        "description",
    }
)

_JSON_TYPES: dict[str, str] = {
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "object": "an object",
    "array": "an array",
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_type(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        # JSON has one number type: 3.0 is an integer; true is not.
        if isinstance(value, float) and value.is_integer():
            return True
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    raise AssertionError(f"unsupported schema type {kind!r}")


def _check(name: str, value: Any, schema: Mapping[str, Any]) -> Any:
    """The value, normalized (3.0 → 3 for integers); raises InvalidArgument."""
    kind = schema.get("type")
    if kind is not None and not _is_type(value, kind):
        raise InvalidArgument(f"{name} must be {_JSON_TYPES[kind]}, got {_short(value)}")
    if kind == "integer" and isinstance(value, float):
        value = int(value)
    if "enum" in schema and value not in schema["enum"]:
        accepted = ", ".join(repr(v) for v in schema["enum"])
        raise InvalidArgument(f"{name}={_short(value)} is not accepted; use one of: {accepted}")
    lo, hi = schema.get("minimum"), schema.get("maximum")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = (
            f"{lo}-{hi}"
            if lo is not None and hi is not None
            else (f">= {lo}" if lo is not None else f"<= {hi}")
        )
        raise InvalidArgument(f"{name}={_short(value)} is out of range; accepted: {bounds}")
    if isinstance(value, str):
        _check_string(name, value, schema)
    if isinstance(value, list):
        most = schema.get("maxItems")
        if most is not None and len(value) > most:
            raise InvalidArgument(f"{name} has {len(value)} items; at most {most} are accepted")
        items = schema.get("items")
        if items is not None:
            value = [_check(f"{name}[{i}]", item, items) for i, item in enumerate(value)]
    if isinstance(value, dict):
        value = _check_object(name, value, schema)
    return value


def _check_string(name: str, value: str, schema: Mapping[str, Any]) -> None:
    least, most = schema.get("minLength"), schema.get("maxLength")
    if least is not None and len(value) < least:
        raise InvalidArgument(
            f"{name} is empty; give a non-empty string"
            if least == 1
            else f"{name} is too short; at least {least} characters"
        )
    if most is not None and len(value) > most:
        raise InvalidArgument(f"{name} has {len(value)} characters; at most {most} are accepted")
    pattern = schema.get("pattern")
    if pattern is not None and not re.search(pattern, value):
        hint = schema.get("description", "")
        raise InvalidArgument(
            f"{name}={_short(value)} is not valid (must match {pattern})"
            + (f": {hint}" if hint else "")
        )


def _check_object(name: str, value: dict[str, Any], schema: Mapping[str, Any]) -> dict[str, Any]:
    properties: Mapping[str, Any] = schema.get("properties", {})
    extra = schema.get("additionalProperties", True)
    for key in schema.get("required", ()):
        if key not in value or value[key] is None:
            described = properties.get(key, {}).get("description", "")
            raise InvalidArgument(
                f"missing required argument {key!r}" + (f" ({described})" if described else "")
                if name == "arguments"
                else f"{name} is missing {key!r}"
            )
    out: dict[str, Any] = {}
    for key, item in value.items():
        where = key if name == "arguments" else f"{name}.{key}"
        if key in properties:
            # null for an optional argument means "not given" (models often send it).
            if item is not None:
                out[key] = _check(where, item, properties[key])
        elif extra is False:
            accepted = ", ".join(properties) or "none"
            raise InvalidArgument(f"unknown argument {where!r}; accepted: {accepted}")
        elif isinstance(extra, Mapping):
            out[key] = _check(where, item, extra)
        else:
            out[key] = item
    return out


def check_arguments(
    schema: Mapping[str, Any], arguments: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Validate a tool call's ``arguments`` against its ``schema``.

    Returns the arguments with defaults filled in, optional ``null``s dropped and
    integral floats made ints. Raises :class:`InvalidArgument` naming the argument.
    """
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        raise InvalidArgument(f"arguments must be a JSON object, got {_short(arguments)}")
    checked = _check_object("arguments", dict(arguments), schema)
    for key, prop in schema.get("properties", {}).items():
        if key not in checked and "default" in prop:
            checked[key] = prop["default"]
    return checked
