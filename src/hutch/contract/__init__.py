"""The contract of API v1: every fact that the daemon, the SDK, MCP and the fakes share.

One home per fact (conventions: "Declare a fact once"): the schemas (``hutch.api``), the
SDK (``hutch.sdk``), the MCP tool catalogue (``hutch.agent_tools.specs``) and the in-memory fake
(``hutch.testing``) import these modules instead of writing their own copies::

    limits        every range, default and size bound of a request
    enums         PauseMode, NetworkMode: the closed sets of words the API takes
    names         names and ids (sandbox, snapshot, network), metadata and env checks
    egress        the egress rule grammar and its canonical form
    views         the result views the REST layer renders (egress, ports, networks)
    http_errors   the one error class <-> (HTTP status, stable code) table
    agent_codes   the guest agent's wire error codes and the classes they map to

Pure: no I/O, and no hutch import but :mod:`hutch.errors` (``tests/unit/test_layers.py``
checks it). Besides the standard library it needs only ``idna`` (the host-name normal
form of egress rules), which the SDK's httpx depends on anyway.
"""
