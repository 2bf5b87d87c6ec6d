"""Names and ids as the API accepts them, and the checks of names, metadata and env.

Every check raises :class:`~hutch.errors.InvalidArgument` with a message that names the
value and says what is accepted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TypeVar

from hutch.contract.limits import (
    ENV_SECRETS_MAX,
    METADATA_KEY_MAX_CHARS,
    METADATA_MAX_KEYS,
    METADATA_VALUE_MAX_CHARS,
    SECRET_NAME_MAX_CHARS,
    SECRET_VALUE_MAX_BYTES,
)
from hutch.errors import InvalidArgument

__all__ = [
    "NAME_PATTERN",
    "NAME_RE",
    "NETWORK_ID_RE",
    "SANDBOX_ID_PATTERN",
    "SANDBOX_ID_RE",
    "SECRET_NAME_PATTERN",
    "SECRET_NAME_RE",
    "SECRET_NAME_RULE",
    "SNAPSHOT_ID_PATTERN",
    "SNAPSHOT_ID_RE",
    "check_range",
    "validate_env",
    "validate_env_secrets",
    "validate_metadata",
    "validate_name",
    "validate_secret_name",
    "validate_secret_value",
]

#: Sandbox, snapshot and network names: 1-63 lowercase letters, digits and '-', starting
#: and ending with a letter or digit (a DNS label, so members resolve each other by name).
NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
NAME_RE = re.compile(NAME_PATTERN)
SANDBOX_ID_PATTERN = r"^sb-[0-9a-f]{12}$"
SANDBOX_ID_RE = re.compile(SANDBOX_ID_PATTERN)
SNAPSHOT_ID_PATTERN = r"^snap-[0-9a-f]{12}$"
SNAPSHOT_ID_RE = re.compile(SNAPSHOT_ID_PATTERN)
NETWORK_ID_RE = re.compile(r"^net-[0-9a-f]{12}$")
#: Secret names: 1-128 letters, digits, '_', '.' and '-', starting with a letter or digit
#: (so ``{secret:NAME}`` in an egress header template needs no quoting).
SECRET_NAME_PATTERN = rf"^[A-Za-z0-9][A-Za-z0-9_.-]{{0,{SECRET_NAME_MAX_CHARS - 1}}}$"
SECRET_NAME_RE = re.compile(SECRET_NAME_PATTERN)
SECRET_NAME_RULE = (
    f"1-{SECRET_NAME_MAX_CHARS} letters, digits, '_', '.' and '-', starting with a letter or digit"
)
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

M = TypeVar("M", bound=Mapping[str, str])


def check_range(name: str, value: int, bounds: tuple[int, int], unit: str = "") -> int:
    """``value`` as given if it is an int (not a bool) within ``bounds`` (inclusive)."""
    lo, hi = bounds
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name}={value!r} is out of range; accepted: {lo}-{hi}{unit}")
    return value


def validate_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise InvalidArgument(
            f"name={name!r} is not valid; use 1-63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    return name


def validate_metadata(metadata: M) -> M:
    if len(metadata) > METADATA_MAX_KEYS:
        raise InvalidArgument(f"metadata has more than {METADATA_MAX_KEYS} keys")
    for key, value in metadata.items():
        if not isinstance(key, str) or not 1 <= len(key) <= METADATA_KEY_MAX_CHARS:
            raise InvalidArgument(
                f"metadata key {key!r} must be a string of 1-{METADATA_KEY_MAX_CHARS} characters"
            )
        if not isinstance(value, str) or len(value) > METADATA_VALUE_MAX_CHARS:
            raise InvalidArgument(
                f"metadata[{key!r}] must be a string of at most {METADATA_VALUE_MAX_CHARS} "
                "characters"
            )
    return metadata


def validate_env(env: M) -> M:
    for key, value in env.items():
        if not _ENV_NAME_RE.match(key):
            raise InvalidArgument(
                f"env name {key!r} is not valid; use letters, digits and '_', not starting "
                "with a digit"
            )
        if "\0" in value:
            raise InvalidArgument(f"env[{key!r}] contains a NUL byte")
    return env


def validate_secret_name(name: str) -> str:
    if not isinstance(name, str) or not SECRET_NAME_RE.match(name):
        raise InvalidArgument(f"secret name {name!r} is not valid; use {SECRET_NAME_RULE}")
    return name


def validate_secret_value(value: str) -> bytes:
    """The value as UTF-8 bytes. The message never quotes the value (it is a secret)."""
    if not isinstance(value, str):
        raise InvalidArgument("a secret's value must be a string (UTF-8 text)")
    try:
        data = value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(
            "a secret's value must be UTF-8 text; it contains a lone surrogate"
        ) from None
    if not 1 <= len(data) <= SECRET_VALUE_MAX_BYTES:
        raise InvalidArgument(
            f"a secret's value must be 1-{SECRET_VALUE_MAX_BYTES} bytes of UTF-8 text; "
            f"this one is {len(data)} bytes"
        )
    if "\0" in value:
        raise InvalidArgument(
            "a secret's value must not contain a NUL byte (it becomes an environment "
            "variable or a header value)"
        )
    return data


def validate_env_secrets(env_secrets: M, env: Mapping[str, str] | None = None) -> M:
    """``{VAR: secret name}``: each VAR an environment variable name not also in ``env``,
    each name a secret name; at most ``ENV_SECRETS_MAX`` entries."""
    if len(env_secrets) > ENV_SECRETS_MAX:
        raise InvalidArgument(
            f"env_secrets has {len(env_secrets)} entries; at most {ENV_SECRETS_MAX} are accepted"
        )
    for var, name in env_secrets.items():
        if not isinstance(var, str) or not _ENV_NAME_RE.match(var):
            raise InvalidArgument(
                f"env_secrets name {var!r} is not a valid environment variable name; use "
                "letters, digits and '_', not starting with a digit"
            )
        if not isinstance(name, str) or not SECRET_NAME_RE.match(name):
            raise InvalidArgument(
                f"env_secrets[{var!r}]: secret name {name!r} is not valid; use {SECRET_NAME_RULE}"
            )
        if env is not None and var in env:
            raise InvalidArgument(
                f"{var!r} is in both env and env_secrets; give each variable once"
            )
    return env_secrets
