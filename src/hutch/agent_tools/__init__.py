"""hutch's sandboxes as agent tools, described and run once for every front end.

- :mod:`hutch.agent_tools.specs`: every tool's name, description and JSON Schema (pure data);
- :mod:`hutch.agent_tools.tools`: ``HutchTools`` runs a tool call through the async SDK.

The MCP server (:mod:`hutch.mcp`) and the LangChain/OpenAI wrappers
(:mod:`hutch.integrations`) are two faces of this one catalogue and never import each
other. Nothing here loads the ``mcp`` SDK.
"""
