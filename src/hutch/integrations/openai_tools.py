"""hutch's sandbox tools in the OpenAI function-calling format, with a dispatcher.

Plain dicts in and out; the ``openai`` package is not needed::

    from hutch.integrations import openai_tools

    response = openai.chat.completions.create(
        model=..., messages=messages, tools=openai_tools.tool_schemas()
    )
    for call in response.choices[0].message.tool_calls or []:
        output = openai_tools.dispatch(call.function.name, call.function.arguments)
        messages.append(
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps(output)}
        )

``tool_schemas(style="responses")`` gives the flat shape of the Responses API and the
OpenAI Agents SDK (``{"type": "function", "name": ..., "parameters": ...}``).

``dispatch`` never raises for a bad call: it returns ``{"ok": False, "error": {"code",
"message"}}`` whose message says what to change, so the model can retry. Success is
``{"ok": True, "result": {...}, "summary": "..."}``.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

import httpx

from hutch.agent_tools.specs import TOOLS
from hutch.agent_tools.tools import ToolError, ToolResult
from hutch.integrations._runner import ToolRunner
from hutch.sdk import AsyncClient, Timeouts

__all__ = ["adispatch", "dispatch", "tool_schemas"]

Style = Literal["chat", "responses"]


def tool_schemas(style: Style = "chat") -> list[dict[str, Any]]:
    """Every hutch tool as an OpenAI tool definition (fresh copies: safe to modify).

    ``style="chat"``: Chat Completions (``{"type": "function", "function": {...}}``);
    ``style="responses"``: Responses API / Agents SDK (the same fields, flat).
    """
    if style not in ("chat", "responses"):
        raise ValueError(f"style={style!r}; accepted: 'chat', 'responses'")
    out: list[dict[str, Any]] = []
    for spec in TOOLS:
        function = {
            "name": spec.name,
            "description": spec.description,
            "parameters": copy.deepcopy(spec.parameters),
        }
        if style == "chat":
            out.append({"type": "function", "function": function})
        else:
            out.append({"type": "function", **function})
    return out


def _parse(name: str, arguments_json: str | dict[str, Any] | None) -> dict[str, Any]:
    if arguments_json is None or isinstance(arguments_json, dict):
        return arguments_json or {}
    if not isinstance(arguments_json, str):
        raise ToolError(name, "arguments must be a JSON object text", "invalid_argument")
    try:
        parsed = json.loads(arguments_json) if arguments_json.strip() else {}
    except ValueError as exc:
        raise ToolError(
            name, f"arguments are not valid JSON ({exc}); send one JSON object", "invalid_argument"
        ) from exc
    if not isinstance(parsed, dict):
        raise ToolError(
            name,
            f"arguments must be a JSON object, got {type(parsed).__name__}",
            "invalid_argument",
        )
    return parsed


def _ok(result: ToolResult) -> dict[str, Any]:
    return {"ok": True, "result": result.data, "summary": result.text}


def _error(exc: ToolError) -> dict[str, Any]:
    return {"ok": False, "error": {"code": exc.code, "message": str(exc)}}


def dispatch(
    name: str,
    arguments_json: str | dict[str, Any] | None,
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    http_timeout: float | Timeouts | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """Run tool ``name`` with the model's ``arguments_json`` (the JSON text of a tool
    call, or an already-parsed dict) and return the answer as a plain dict.

    The daemon is found as the SDK finds it (``HUTCH_URL``, ``HUTCH_API_KEY`` or the
    key file) unless ``base_url``/``api_key`` say otherwise.
    """
    runner = ToolRunner(
        base_url=base_url, api_key=api_key, http_timeout=http_timeout, transport=transport
    )
    try:
        return _ok(runner.call(name, _parse(name, arguments_json)))
    except ToolError as exc:
        return _error(exc)


async def adispatch(
    name: str,
    arguments_json: str | dict[str, Any] | None,
    *,
    client: AsyncClient | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    http_timeout: float | Timeouts | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> dict[str, Any]:
    """:func:`dispatch` for asyncio code; ``client`` (not closed here) is reused."""
    runner = ToolRunner(
        client, base_url=base_url, api_key=api_key, http_timeout=http_timeout, transport=transport
    )
    try:
        return _ok(await runner.acall(name, _parse(name, arguments_json)))
    except ToolError as exc:
        return _error(exc)
