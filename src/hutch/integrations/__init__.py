"""hutch's sandbox tools for agent frameworks, as thin wrappers over the SDK.

- :mod:`hutch.integrations.openai_tools`: OpenAI function-calling definitions and a
  dispatcher (plain dicts; no ``openai`` package needed);
- :mod:`hutch.integrations.langchain`: LangChain ``StructuredTool``\\ s (needs the
  ``langchain`` extra: ``pip install 'hutch[langchain]'``).

Both take their names, descriptions and JSON Schemas from :mod:`hutch.agent_tools.specs`, the
same definitions the MCP server lists, and run calls through :mod:`hutch.agent_tools.tools`.
"""
