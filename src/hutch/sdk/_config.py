"""Where the SDK finds the daemon and its key, and how long it waits for it.

Resolution order (first hit wins):

- base URL: ``base_url`` argument, env ``HUTCH_URL``, ``http://127.0.0.1:7070``;
- API key: ``api_key`` argument, env ``HUTCH_API_KEY``, the file
  ``$HUTCH_STATE_DIR/api-key`` (``HUTCH_STATE_DIR`` defaults to ``./var``), which the
  daemon writes on its first start;
- project: ``project`` argument, env ``HUTCH_PROJECT``, else none (sent as the
  ``Hutch-Project`` header: the admin key acts in it, ``default`` without; a project
  key acts in its own project, and naming another is refused).

A missing key is not an error until a request needs one, so ``/healthz`` works without.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hutch.contract.names import NAME_RE
from hutch.errors import InvalidArgument
from hutch.sdk._errors import ApiKeyMissing

__all__ = ["DEFAULT_URL", "ClientConfig", "Timeouts", "resolve_config"]

DEFAULT_URL = "http://127.0.0.1:7070"


@dataclass(frozen=True)
class Timeouts:
    """HTTP timeouts in seconds; ``None`` waits forever.

    ``read`` bounds the wait for each chunk of an answer. Calls whose length the caller
    controls get their own bound instead: ``exec`` waits ``timeout_s + read`` when the
    command has a ``timeout_s`` and forever otherwise (the daemon enforces the limit),
    ``create`` waits ``create`` seconds (booting a guest under TCG takes a while), and
    ``pause``/``resume``/``fork``/``snapshot`` wait ``lifecycle`` seconds (they write or
    restore guest memory, or boot a disk-paused guest again; a fork of many children
    takes longest).
    """

    connect: float | None = 5.0
    read: float | None = 60.0
    write: float | None = 60.0
    pool: float | None = 10.0
    create: float | None = 600.0
    lifecycle: float | None = 600.0

    @classmethod
    def coerce(cls, value: float | Timeouts | None) -> Timeouts:
        """A number sets every timeout; ``None`` means the defaults."""
        if value is None:
            return cls()
        if isinstance(value, Timeouts):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise InvalidArgument(
                f"http_timeout={value!r}: give seconds > 0 or a hutch.sdk.Timeouts"
            )
        v = float(value)
        return cls(connect=v, read=v, write=v, pool=v, create=v, lifecycle=v)

    def as_httpx(self) -> dict[str, float | None]:
        """The ``timeout`` request extension httpx transports read."""
        return self.with_read(self.read)

    def with_read(self, read: float | None) -> dict[str, float | None]:
        """Like :meth:`as_httpx` with another read timeout (long calls)."""
        return {"connect": self.connect, "read": read, "write": self.write, "pool": self.pool}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    api_key: str | None
    project: str | None
    # Where the key was looked for, for the error message when it is missing.
    key_file: Path
    timeouts: Timeouts

    def require_key(self) -> str:
        if self.api_key is None:
            raise ApiKeyMissing(
                "no hutch API key: pass api_key=..., set HUTCH_API_KEY, or make sure the "
                f"key file {self.key_file} exists (the daemon writes it on first start; "
                "set HUTCH_STATE_DIR to the daemon's state directory if it is elsewhere)"
            )
        return self.api_key


def resolve_config(
    *,
    base_url: str | None = None,
    api_key: str | None = None,
    timeouts: float | Timeouts | None = None,
    env: Mapping[str, str] | None = None,
    project: str | None = None,
) -> ClientConfig:
    """Resolve the client settings; see the module docstring for the order."""
    env = os.environ if env is None else env
    url = (base_url or env.get("HUTCH_URL") or DEFAULT_URL).strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise InvalidArgument(
            f"base URL {url!r} must start with http:// or https:// "
            f"(example: {DEFAULT_URL}); check the base_url argument or HUTCH_URL"
        )
    key_file = Path(env.get("HUTCH_STATE_DIR") or "./var") / "api-key"
    given = api_key or env.get("HUTCH_API_KEY")
    if given and given != given.strip():
        # HTTP drops whitespace around a header value, so sending it would not send
        # the key as given; the daemon compares keys exactly.
        source = "api_key" if api_key else "HUTCH_API_KEY"
        raise InvalidArgument(
            f"the API key in {source} starts or ends with whitespace; API keys have none "
            "(copy it from the key file again, without the trailing newline)"
        )
    key = given or _read_key_file(key_file)
    named = project or env.get("HUTCH_PROJECT") or None
    if named is not None and not NAME_RE.match(named):
        source = "project" if project else "HUTCH_PROJECT"
        raise InvalidArgument(
            f"{source}={named!r} is not a project name; use 1-63 lowercase letters, digits "
            "and '-', starting and ending with a letter or digit"
        )
    return ClientConfig(
        base_url=url,
        api_key=key or None,
        project=named,
        key_file=key_file,
        timeouts=Timeouts.coerce(timeouts),
    )


def _read_key_file(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ApiKeyMissing(
            f"cannot read the API key file {path}: {exc.strerror}; fix its permissions "
            "or set HUTCH_API_KEY"
        ) from exc
    return text or None
