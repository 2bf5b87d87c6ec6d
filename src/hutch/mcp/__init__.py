"""``hutch mcp``: the MCP server (:mod:`hutch.mcp.server`), stdio or streamable HTTP.

The tools it serves are described and run by :mod:`hutch.agent_tools`, which the
LangChain/OpenAI wrappers share; this package holds only the MCP transport.
"""
