"""The one definition of every hutch agent tool: name, description, JSON Schema.

The MCP server (:mod:`hutch.mcp.server`), the LangChain tools and the OpenAI
function-calling definitions (:mod:`hutch.integrations`) all read these, so a tool is
described once. Pure data: no I/O, no dependency on the ``mcp`` package.

The schemas use a small, portable subset of JSON Schema (``type``, ``enum``, ``minimum``
/``maximum``, ``minLength``/``maxLength``, ``pattern``, ``items``, ``maxItems``,
``additionalProperties``, ``required``, ``default``) that every model vendor accepts and
that :mod:`hutch.agent_tools._validate` checks in full, with messages a model can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hutch.contract.enums import DEFAULT_PAUSE_MODE, PauseMode
from hutch.contract.limits import (
    DEFAULT_DISK_GIB,
    DEFAULT_FILE_MODE,
    DEFAULT_FORK_COUNT,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MIB,
    DEFAULT_VCPUS,
    DISK_GIB_RANGE,
    EGRESS_RULE_MAX_CHARS,
    FORK_COUNT_RANGE,
    MAX_EGRESS_RULES,
    MEMORY_MIB_RANGE,
    PATH_MAX_CHARS,
    STDIN_MAX_CHARS,
    TIMEOUT_S_RANGE,
    VCPUS_RANGE,
)
from hutch.contract.names import (
    NAME_PATTERN,
    SANDBOX_ID_PATTERN,
    SECRET_NAME_PATTERN,
    SNAPSHOT_ID_PATTERN,
)
from hutch.contract.volumes import MAX_VOLUMES_PER_SANDBOX

__all__ = [
    "DEFAULT_MAX_OUTPUT_CHARS",
    "DEFAULT_READ_MAX_BYTES",
    "DEFAULT_RUN_TIMEOUT_S",
    "MAX_EGRESS_RULES",
    "MAX_RUN_TIMEOUT_S",
    "TOOLS",
    "TOOLS_BY_NAME",
    "ToolSpec",
]

DEFAULT_RUN_TIMEOUT_S = 60
MAX_RUN_TIMEOUT_S = 3600
DEFAULT_MAX_OUTPUT_CHARS = 20_000
MAX_OUTPUT_CHARS = 1_000_000
DEFAULT_READ_MAX_BYTES = 100_000
MAX_READ_BYTES = 10 * 1024 * 1024

SANDBOX_STATES = (
    "creating",
    "running",
    "pausing",
    "paused",
    "resuming",
    "stopping",
    "destroyed",
    "failed",
)


@dataclass(frozen=True)
class ToolSpec:
    """One tool as every framework sees it.

    ``read_only``/``destructive``/``idempotent`` become MCP tool annotations (hints for
    clients that ask the user before a destructive call).
    """

    name: str
    title: str
    description: str
    parameters: dict[str, Any]
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    @property
    def required(self) -> tuple[str, ...]:
        return tuple(self.parameters.get("required", ()))


def _obj(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


_SANDBOX_ID: dict[str, Any] = {
    "type": "string",
    "pattern": SANDBOX_ID_PATTERN,
    "description": "Sandbox id, as returned by create_sandbox or list_sandboxes "
    "(looks like sb-0123456789ab).",
}
_PATH: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": PATH_MAX_CHARS,
    "description": "Path in the sandbox: absolute, or relative to /root. "
    "Not under /proc, /sys or /dev.",
}
_STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}


def _int(lo: int, hi: int, description: str, default: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "integer",
        "minimum": lo,
        "maximum": hi,
        "description": description,
    }
    if default is not None:
        schema["default"] = default
    return schema


CREATE_SANDBOX = ToolSpec(
    name="create_sandbox",
    title="Create sandbox",
    description=(
        "Create a new isolated Linux sandbox (its own micro-VM and kernel) and wait until "
        "it runs. Returns the sandbox, whose `id` the other tools take. Sandboxes keep "
        "running (and using host resources) until delete_sandbox or their timeout_s."
    ),
    parameters=_obj(
        {
            "image": {
                "type": "string",
                "pattern": r"^[a-z0-9][a-z0-9-]{0,62}$",
                "default": DEFAULT_IMAGE,
                "description": "Disk image: `base` (Debian 12 with Python 3 and curl) "
                "or `devbox` (base plus build tools).",
            },
            "vcpus": _int(*VCPUS_RANGE, "Virtual CPUs.", DEFAULT_VCPUS),
            "memory_mib": _int(*MEMORY_MIB_RANGE, "Memory in MiB.", DEFAULT_MEMORY_MIB),
            "disk_gib": _int(*DISK_GIB_RANGE, "Disk size in GiB.", DEFAULT_DISK_GIB),
            "name": {
                "type": "string",
                "pattern": NAME_PATTERN,
                "description": "Optional unique name: 1-63 lowercase letters, digits, '-'.",
            },
            "env": {
                **_STRING_MAP,
                "description": "Environment variables for every command in the sandbox.",
            },
            "env_secrets": {
                "type": "object",
                "additionalProperties": {"type": "string", "pattern": SECRET_NAME_PATTERN},
                "description": "Environment variables whose values are stored secrets of "
                "the project, as {VAR: secret name} (list_secrets shows the names). Every "
                "command in the sandbox gets the current value; no tool shows it.",
            },
            "metadata": {
                **_STRING_MAP,
                "description": "Free-form labels (string to string); list_sandboxes "
                "can filter by them.",
            },
            "timeout_s": _int(
                *TIMEOUT_S_RANGE,
                "Delete the sandbox automatically this many seconds after it starts. "
                "Omit to keep it until delete_sandbox.",
            ),
            "snapshot": {
                "type": "string",
                "pattern": SNAPSHOT_ID_PATTERN,
                "description": "Start from this named snapshot (its image and size win).",
            },
            "volumes": {
                "type": "array",
                "maxItems": MAX_VOLUMES_PER_SANDBOX,
                "items": {"type": "string", "minLength": 3},
                "description": "Volumes to mount, each `NAME:/path` or `NAME:/path:ro` "
                "(see list_volumes). A volume's data outlives the sandbox.",
            },
        },
        [],
    ),
)

LIST_VOLUMES = ToolSpec(
    name="list_volumes",
    title="List volumes",
    description="List the project's volumes (persistent filesystems mounted at create with "
    "create_sandbox `volumes`): name, size and used bytes, and which sandboxes mount them.",
    parameters=_obj({}, []),
    read_only=True,
    idempotent=True,
)

LIST_SANDBOXES = ToolSpec(
    name="list_sandboxes",
    title="List sandboxes",
    description="List sandboxes (all but destroyed ones unless `state` is given).",
    parameters=_obj(
        {
            "state": {
                "type": "string",
                "enum": list(SANDBOX_STATES),
                "description": "Only sandboxes in this state.",
            },
            "metadata": {
                **_STRING_MAP,
                "description": "Only sandboxes whose metadata has all these key/values.",
            },
        },
        [],
    ),
    read_only=True,
    idempotent=True,
)

DELETE_SANDBOX = ToolSpec(
    name="delete_sandbox",
    title="Delete sandbox",
    description="Destroy a sandbox and everything in it (processes, files). "
    "Deleting one that is already gone succeeds.",
    parameters=_obj({"sandbox_id": _SANDBOX_ID}, ["sandbox_id"]),
    destructive=True,
    idempotent=True,
)

RUN_COMMAND = ToolSpec(
    name="run_command",
    title="Run command",
    description=(
        "Run a shell command (/bin/sh -c) in a running sandbox and wait for it to finish. "
        "Returns exit_code, stdout and stderr. Output longer than max_output_chars keeps "
        "its beginning and end, with a line `[output truncated: N of M bytes shown]` in "
        "between. A command still running after timeout_s is killed and reported with "
        "timed_out=true and the output it printed so far; run long jobs in the background "
        "(`nohup cmd > /tmp/log 2>&1 &`) and poll the log instead."
    ),
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "command": {
                "type": "string",
                "minLength": 1,
                "maxLength": 100_000,
                "description": "Shell command line, e.g. `python3 -c 'print(1+1)'` or "
                "`cd /root/app && make test`.",
            },
            "cwd": {**_PATH, "description": "Working directory (default /root)."},
            "env": {**_STRING_MAP, "description": "Extra environment variables."},
            "stdin": {
                "type": "string",
                "maxLength": STDIN_MAX_CHARS,
                "description": "Text sent to the command's standard input.",
            },
            "timeout_s": _int(
                1,
                MAX_RUN_TIMEOUT_S,
                "Kill the command after this many seconds.",
                DEFAULT_RUN_TIMEOUT_S,
            ),
            "max_output_chars": _int(
                100,
                MAX_OUTPUT_CHARS,
                "Most characters of stdout, and separately of stderr, to return.",
                DEFAULT_MAX_OUTPUT_CHARS,
            ),
        },
        ["sandbox_id", "command"],
    ),
)

_ENCODING: dict[str, Any] = {
    "type": "string",
    "enum": ["utf-8", "base64"],
    "default": "utf-8",
}

READ_FILE = ToolSpec(
    name="read_file",
    title="Read file",
    description=(
        "Read a file from a sandbox. Text comes back as UTF-8; use encoding=base64 for "
        "binary files. Files longer than max_bytes return their first max_bytes with "
        "`[output truncated: N of M bytes shown]` appended."
    ),
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "path": _PATH,
            "encoding": {**_ENCODING, "description": "How to return the content."},
            "max_bytes": _int(
                1, MAX_READ_BYTES, "Most bytes of the file to return.", DEFAULT_READ_MAX_BYTES
            ),
        },
        ["sandbox_id", "path"],
    ),
    read_only=True,
    idempotent=True,
)

WRITE_FILE = ToolSpec(
    name="write_file",
    title="Write file",
    description="Create or replace a file in a sandbox (parent directories are created).",
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "path": _PATH,
            "content": {
                "type": "string",
                "maxLength": 50 * 1024 * 1024,
                "description": "The whole new content of the file.",
            },
            "encoding": {
                **_ENCODING,
                "description": "How `content` is encoded: utf-8 text, or base64 for binary data.",
            },
            "mode": {
                "type": "string",
                "pattern": r"^0?[0-7]{3}$",
                "default": format(DEFAULT_FILE_MODE, "04o"),
                "description": "Permission bits in octal, e.g. 0644 or 0755.",
            },
        },
        ["sandbox_id", "path", "content"],
    ),
    idempotent=True,
)

LIST_FILES = ToolSpec(
    name="list_files",
    title="List files",
    description="List a directory in a sandbox: name, type (file, dir, symlink, ...), "
    "size in bytes and octal mode of each entry.",
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "path": {
                **_PATH,
                "default": ".",
                "description": _PATH["description"] + " Default: /root.",
            },
        },
        ["sandbox_id"],
    ),
    read_only=True,
    idempotent=True,
)

PAUSE_SANDBOX = ToolSpec(
    name="pause_sandbox",
    title="Pause sandbox",
    description=(
        "Pause a running sandbox: it stops using CPU and host memory. mode=memory keeps "
        "running processes (they continue after resume_sandbox); mode=disk keeps only "
        "the files (the machine boots again on resume)."
    ),
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "mode": {
                "type": "string",
                "enum": [m.value for m in PauseMode],
                "default": DEFAULT_PAUSE_MODE.value,
                "description": "What to keep while paused.",
            },
        },
        ["sandbox_id"],
    ),
)

RESUME_SANDBOX = ToolSpec(
    name="resume_sandbox",
    title="Resume sandbox",
    description="Resume a paused sandbox. A running one is left as it is.",
    parameters=_obj({"sandbox_id": _SANDBOX_ID}, ["sandbox_id"]),
    idempotent=True,
)

FORK_SANDBOX = ToolSpec(
    name="fork_sandbox",
    title="Fork sandbox",
    description=(
        "Make `count` copies of a running or paused sandbox, each with the same files, "
        "memory and running processes at this moment, but its own identity. The original "
        "keeps running. Returns the new sandboxes."
    ),
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "count": _int(*FORK_COUNT_RANGE, "How many copies.", DEFAULT_FORK_COUNT),
        },
        ["sandbox_id"],
    ),
)

_RULES_HELP = (
    "Each rule is one of: `host` (example.com), `host:port`, `*.host` (any subdomain), "
    "`ip`, `ip:port`, `cidr` (10.0.0.0/8), `cidr:port` (IPv6 as [2001:db8::1]:443), or "
    "`deny-all` alone."
)

SET_EGRESS = ToolSpec(
    name="set_egress",
    title="Set egress rules",
    description=(
        "Replace a sandbox's outbound network rules, live. With no rules egress is open; "
        "once any rule exists everything not allowed is denied (DNS too). "
        + _RULES_HELP
        + " Instead of rules, give `policy`: an ordered policy object (first match wins) "
        '{"default": "deny", "rules": [{"action": "deny", "host": "evil.example.com"}, '
        '{"action": "allow", "host": "*.example.com:443"}]}, or `policy_name` (a saved one).'
        " An invalid rule rejects the whole request and the old rules stay."
    ),
    parameters=_obj(
        {
            "sandbox_id": _SANDBOX_ID,
            "rules": {
                "type": "array",
                "maxItems": MAX_EGRESS_RULES,
                "items": {"type": "string", "minLength": 1, "maxLength": EGRESS_RULE_MAX_CHARS},
                "description": 'All rules ([] opens egress, ["deny-all"] closes it).',
            },
            "policy": {
                "type": "object",
                "description": "An ordered policy {default: allow|deny, rules: [{action: "
                "allow|deny, host}]}; give this, policy_name or rules.",
            },
            "policy_name": {
                "type": "string",
                "minLength": 1,
                "description": "The name of a saved policy to copy; give this, policy or rules.",
            },
        },
        ["sandbox_id"],
    ),
    idempotent=True,
)

GET_EGRESS = ToolSpec(
    name="get_egress",
    title="Get egress rules",
    description="A sandbox's outbound network rules, its mode (open, rules or deny-all) "
    "and how many connections were allowed and denied.",
    parameters=_obj({"sandbox_id": _SANDBOX_ID}, ["sandbox_id"]),
    read_only=True,
    idempotent=True,
)

SUGGEST_EGRESS = ToolSpec(
    name="suggest_egress",
    title="Suggest an egress policy",
    description="The smallest ordered egress policy that allows exactly what a sandbox "
    'used, from its egress log (set the policy {"inspection": "learn"} first and run '
    "the workload: everything passes and every web request is logged). Apply the answer "
    "with set_egress's policy.",
    parameters=_obj({"sandbox_id": _SANDBOX_ID}, ["sandbox_id"]),
    read_only=True,
    idempotent=True,
)

LIST_SECRETS = ToolSpec(
    name="list_secrets",
    title="List secrets",
    description="The names and versions of the project's stored secrets (never their "
    "values: no tool reads one). Give a sandbox one as an environment variable with "
    "create_sandbox's env_secrets.",
    parameters=_obj({}, []),
    read_only=True,
    idempotent=True,
)

TOOLS: tuple[ToolSpec, ...] = (
    CREATE_SANDBOX,
    LIST_SANDBOXES,
    LIST_VOLUMES,
    DELETE_SANDBOX,
    RUN_COMMAND,
    READ_FILE,
    WRITE_FILE,
    LIST_FILES,
    PAUSE_SANDBOX,
    RESUME_SANDBOX,
    FORK_SANDBOX,
    SET_EGRESS,
    GET_EGRESS,
    SUGGEST_EGRESS,
    LIST_SECRETS,
)
TOOLS_BY_NAME: dict[str, ToolSpec] = {spec.name: spec for spec in TOOLS}
