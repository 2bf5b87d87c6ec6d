"""hutch's sandboxes as agent tools.

- :mod:`hutch.mcp.specs`: every tool's name, description and JSON Schema (pure data);
- :mod:`hutch.mcp.tools`: ``HutchTools`` runs a tool call through the async SDK;
- :mod:`hutch.mcp.server`: the MCP server (``hutch mcp``), stdio or streamable HTTP.

This package's ``__init__`` imports nothing, so the LangChain/OpenAI wrappers can use
the specs and tools without loading the ``mcp`` SDK.
"""
