"""hutch's sandbox tools as LangChain ``StructuredTool``\\ s.

Needs ``langchain-core`` (``pip install 'hutch[langchain]'``)::

    from hutch.integrations.langchain import hutch_tools

    agent = create_agent(model, tools=hutch_tools())

Each tool has the JSON Schema the MCP server lists (:mod:`hutch.agent_tools.specs`), runs sync
(``invoke``) or async (``ainvoke``), and answers with ``content_and_artifact``: the text
for the model, and the structured result as the ``ToolMessage`` artifact. A failed call
becomes the tool's output text (``handle_tool_error``), saying what to change, so the
agent can correct itself instead of crashing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from hutch.agent_tools.specs import TOOLS, TOOLS_BY_NAME, ToolSpec
from hutch.agent_tools.tools import ToolError
from hutch.errors import HutchError
from hutch.integrations._runner import ToolRunner
from hutch.sdk import AsyncClient, Timeouts

if TYPE_CHECKING:
    from langchain_core.tools import StructuredTool

__all__ = ["LangChainMissing", "hutch_tool", "hutch_tools"]


class LangChainMissing(HutchError, ImportError):
    """``langchain-core`` is not installed (an ``ImportError`` too, as callers expect)."""

    code = "missing_dependency"


def _structured_tool_class() -> type[StructuredTool]:
    try:
        from langchain_core.tools import StructuredTool
    except ImportError as exc:
        raise LangChainMissing(
            "hutch's LangChain tools need langchain-core: pip install 'hutch[langchain]' "
            "(or pip install langchain-core==1.8.1)"
        ) from exc
    return StructuredTool


def _tool_exception(exc: ToolError) -> Exception:
    from langchain_core.tools import ToolException

    return ToolException(str(exc))


def hutch_tool(spec: ToolSpec | str, runner: ToolRunner) -> StructuredTool:
    """One hutch tool (by spec or name) as a LangChain tool run by ``runner``."""
    structured_tool = _structured_tool_class()
    if isinstance(spec, str):
        if spec not in TOOLS_BY_NAME:
            raise ValueError(f"no hutch tool {spec!r}; available: {', '.join(TOOLS_BY_NAME)}")
        spec = TOOLS_BY_NAME[spec]
    name = spec.name

    def run(**kwargs: Any) -> tuple[str, dict[str, Any]]:
        try:
            result = runner.call(name, kwargs)
        except ToolError as exc:
            raise _tool_exception(exc) from exc
        return result.text, result.data

    async def arun(**kwargs: Any) -> tuple[str, dict[str, Any]]:
        try:
            result = await runner.acall(name, kwargs)
        except ToolError as exc:
            raise _tool_exception(exc) from exc
        return result.text, result.data

    return structured_tool.from_function(
        func=run,
        coroutine=arun,
        name=name,
        description=spec.description,
        args_schema=spec.parameters,
        infer_schema=False,
        response_format="content_and_artifact",
        handle_tool_error=True,
    )


def hutch_tools(
    client: AsyncClient | None = None,
    *,
    names: list[str] | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    http_timeout: float | Timeouts | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[StructuredTool]:
    """All hutch tools (or those in ``names``) as LangChain tools.

    ``client`` is shared by async calls (the caller closes it); sync calls and calls
    without one open a short-lived client to the same daemon (``base_url``/``api_key``,
    by default as the SDK resolves them: ``HUTCH_URL``, ``HUTCH_API_KEY``, key file).
    """
    runner = ToolRunner(
        client, base_url=base_url, api_key=api_key, http_timeout=http_timeout, transport=transport
    )
    wanted = names if names is not None else [spec.name for spec in TOOLS]
    return [hutch_tool(name, runner) for name in wanted]
