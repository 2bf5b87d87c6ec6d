"""Every range, default and size bound of API v1, written once.

Ranges are inclusive ``(low, high)`` pairs. Sizes are in the unit their name says
(``_CHARS`` characters of a JSON string, ``_BYTES`` bytes, ``_S`` seconds). The request
schemas (``hutch.api``), the SDK's checks before sending, the MCP tool schemas and the
in-memory fake all read them from here.
"""

from __future__ import annotations

__all__ = [
    "ARCHIVE_MAX_BYTES",
    "AUTO_DELETE_S_RANGE",
    "AUTO_PAUSE_S_RANGE",
    "BUILD_ARGS_MAX",
    "BUILD_ARG_MAX_CHARS",
    "BUILD_OUTPUT_TAIL_BYTES",
    "BUILD_TIMEOUT_S_RANGE",
    "CMD_ARG_MAX_CHARS",
    "CMD_MAX_CHARS",
    "CODE_MAX_CHARS",
    "COLLECTED_EXEC_MAX_BYTES",
    "COLLECTED_RUN_MAX_BYTES",
    "DEFAULT_BUILD_TIMEOUT_S",
    "DEFAULT_DISK_GIB",
    "DEFAULT_EGRESS_LOG_LIMIT",
    "DEFAULT_FILE_MODE",
    "DEFAULT_FORK_COUNT",
    "DEFAULT_IMAGE",
    "DEFAULT_MEMORY_MIB",
    "DEFAULT_PTY_COLS",
    "DEFAULT_PTY_ROWS",
    "DEFAULT_TERM",
    "DEFAULT_VCPUS",
    "DISK_GIB_RANGE",
    "DOCKERFILE_MAX_BYTES",
    "DOCKERFILE_MAX_INSTRUCTIONS",
    "EGRESS_LOG_MAX",
    "EGRESS_RULE_MAX_CHARS",
    "ENV_MAX_VARS",
    "ENV_SECRETS_MAX",
    "EXEC_TIMEOUT_S_MAX",
    "EXPOSE_RANGE_MAX",
    "FORK_COUNT_RANGE",
    "ID_MAX_CHARS",
    "IMAGE_NAME_MAX_CHARS",
    "JSON_BODY_MAX_BYTES",
    "MAX_EGRESS_RULES",
    "MAX_NETWORKS_PER_SANDBOX",
    "MEMORY_MIB_RANGE",
    "METADATA_KEY_MAX_CHARS",
    "METADATA_MAX_KEYS",
    "METADATA_VALUE_MAX_CHARS",
    "NAME_MAX_CHARS",
    "PATH_MAX_CHARS",
    "PORT_RANGE",
    "PROCESS_TIMEOUT_S_MAX",
    "PTY_CMD_MAX_CHARS",
    "PTY_SIZE_RANGE",
    "RUN_TIMEOUT_S_MAX",
    "SECRET_NAME_MAX_CHARS",
    "SECRET_VALUE_MAX_BYTES",
    "STDIN_MAX_CHARS",
    "TERM_MAX_CHARS",
    "TIMEOUT_S_RANGE",
    "USER_MAX_CHARS",
    "VCPUS_RANGE",
    "WATCH_S_MAX",
]

_DAY_S = 24 * 3600

# -- a sandbox's shape and lifetime (POST /v1/sandboxes) --------------------------------
#: What a create asks for when it names no image or shape.
DEFAULT_IMAGE = "base"
DEFAULT_VCPUS = 1
DEFAULT_MEMORY_MIB = 512
DEFAULT_DISK_GIB = 4
VCPUS_RANGE = (1, 8)
MEMORY_MIB_RANGE = (128, 16 * 1024)
DISK_GIB_RANGE = (1, 60)
#: ``timeout_s``: the daemon destroys the sandbox that many seconds after it starts.
TIMEOUT_S_RANGE = (1, 30 * _DAY_S)
#: ``auto_pause_s``: idle seconds before a memory pause; ``auto_delete_s``: seconds
#: paused before the sandbox is deleted.
AUTO_PAUSE_S_RANGE = (60, _DAY_S)
AUTO_DELETE_S_RANGE = (60, 30 * _DAY_S)
FORK_COUNT_RANGE = (1, 100)
DEFAULT_FORK_COUNT = 1
IMAGE_NAME_MAX_CHARS = 64
#: Sandbox, snapshot and network names (see ``hutch.contract.names``).
NAME_MAX_CHARS = 63
#: A reference by id or name (a snapshot, a network, a terminal).
ID_MAX_CHARS = 64
ENV_MAX_VARS = 256
METADATA_MAX_KEYS = 64
METADATA_KEY_MAX_CHARS = 128
METADATA_VALUE_MAX_CHARS = 1024

# -- commands: exec, background processes, terminals, code runs --------------------------
#: One argument of an argv list, and a whole shell string.
CMD_ARG_MAX_CHARS = 65536
CMD_MAX_CHARS = 262144
PATH_MAX_CHARS = 4096
USER_MAX_CHARS = 64
STDIN_MAX_CHARS = 8 * 1024 * 1024
EXEC_TIMEOUT_S_MAX = _DAY_S
PROCESS_TIMEOUT_S_MAX = 7 * _DAY_S
#: A collected (not streamed) exec answer is cut past this; stream for more.
COLLECTED_EXEC_MAX_BYTES = 16 * 1024 * 1024
#: Terminal size in rows and columns (the guest agent enforces the same range).
PTY_SIZE_RANGE = (1, 1000)
DEFAULT_PTY_ROWS = 24
DEFAULT_PTY_COLS = 80
DEFAULT_TERM = "xterm-256color"
TERM_MAX_CHARS = 64
PTY_CMD_MAX_CHARS = 65536
#: Code interpreter runs: the code, its deadline and what a collected answer holds.
CODE_MAX_CHARS = 4 * 1024 * 1024
RUN_TIMEOUT_S_MAX = _DAY_S
COLLECTED_RUN_MAX_BYTES = 64 * 1024 * 1024

# -- files ------------------------------------------------------------------------------
#: Permission bits of a written file unless the request names others.
DEFAULT_FILE_MODE = 0o644
#: A directory upload is refused past this while it streams.
ARCHIVE_MAX_BYTES = 8 * 1024**3
WATCH_S_MAX = 7 * _DAY_S
#: A JSON request body is refused (413) past this while it streams.
JSON_BODY_MAX_BYTES = 16 * 1024 * 1024

# -- image builds (POST /v1/images?dockerfile=...) ---------------------------------------
#: A Dockerfile's size and instructions (continuations joined).
DOCKERFILE_MAX_BYTES = 1024 * 1024
DOCKERFILE_MAX_INSTRUCTIONS = 1000
#: ``--build-arg NAME=value``: how many, and the longest value.
BUILD_ARGS_MAX = 256
BUILD_ARG_MAX_CHARS = 65536
#: A whole build's deadline (every step, the base image and the final filesystem).
BUILD_TIMEOUT_S_RANGE = (60, _DAY_S)
DEFAULT_BUILD_TIMEOUT_S = 3600
#: The end of a failed step's output carried in its error.
BUILD_OUTPUT_TAIL_BYTES = 4096
#: ``EXPOSE 8000-8010``: the most ports one range may name.
EXPOSE_RANGE_MAX = 1024

# -- networking ---------------------------------------------------------------------------
#: Egress rules per sandbox (more is refused, whole).
MAX_EGRESS_RULES = 256
#: Longest rule text: a 253-character name plus ``:65535``, or a bracketed IPv6 CIDR.
EGRESS_RULE_MAX_CHARS = 300
#: The daemon keeps the newest this-many egress decisions per sandbox.
EGRESS_LOG_MAX = 1000
DEFAULT_EGRESS_LOG_LIMIT = 100
MAX_NETWORKS_PER_SANDBOX = 16
PORT_RANGE = (1, 65535)

# -- secrets (/v1/secrets; env_secrets at create) ---------------------------------------
#: A secret's name: see ``hutch.contract.names.SECRET_NAME_PATTERN``.
SECRET_NAME_MAX_CHARS = 128
#: A secret's value: UTF-8 text without NUL, 1 byte to 64 KiB (a PEM key or a token fits;
#: a secret is an environment variable or a header value, never a file).
SECRET_VALUE_MAX_BYTES = 64 * 1024
#: ``env_secrets`` entries of one sandbox.
ENV_SECRETS_MAX = 64
