"""The sans-IO core shared by the sync and async clients: request plumbing.

Everything that is not I/O lives in the core: :class:`ClientCore` builds each request (as
an ``httpx.Request``, which is plain data) and maps failures to hutch errors; one module
per resource builds that resource's requests and reads its answers (``_sandboxes``,
``_exec``, ``_files``, ``_processes``, ``_contexts``, ``_net``, ``_pty``). The shells
(``_async/``, written by hand, and ``_sync/``, generated from it) only send requests and
move bytes, so the two stay in step by construction.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlsplit

import httpx

from hutch.errors import HutchError, InvalidArgument, Timeout
from hutch.sdk._config import ClientConfig
from hutch.sdk._errors import DaemonUnreachable, ProtocolError, error_from_body
from hutch.version import __version__

__all__ = ["Call", "ClientCore", "check_path", "json_of", "list_of", "nothing", "one"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its successful (status < 400), fully read answer."""

    request: httpx.Request
    parse: Callable[[httpx.Response], T]


def json_of(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise ProtocolError(
            f"{response.request.method} {response.request.url.path}: the answer is not "
            f"JSON (HTTP {response.status_code}); is {response.request.url.host} a hutch "
            "daemon?"
        ) from exc


def list_of(key: str, parse: Callable[[Any], T]) -> Callable[[httpx.Response], list[T]]:
    """A reader of ``{key: [item, ...]}`` answers."""

    def reader(response: httpx.Response) -> list[T]:
        body = json_of(response)
        items = body.get(key) if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise ProtocolError(f"expected {{{key!r}: [...]}} from {response.request.url.path}")
        return [parse(item) for item in items]

    return reader


def one(parse: Callable[[Any], T]) -> Callable[[httpx.Response], T]:
    """A reader of answers that are one JSON object."""
    return lambda response: parse(json_of(response))


def nothing(response: httpx.Response) -> None:
    return None


def check_path(path: str, what: str = "path") -> str:
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"{what} must be a non-empty string, got {path!r}")
    return path


class _Default(enum.Enum):
    READ = "the configured read timeout"


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class ClientCore:
    """The plumbing every resource module builds its requests with (base URL, key,
    headers, timeouts) and the mapping of transport failures. No I/O."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config

    @property
    def base_url(self) -> str:
        return self.config.base_url

    @property
    def trust_env(self) -> bool:
        # Never route loopback traffic through an HTTP(S)_PROXY from the environment.
        return not _is_loopback(self.config.base_url)

    def request(
        self,
        method: str,
        path: str,
        *,
        params: Sequence[tuple[str, str]] | None = None,
        json_body: Any = None,
        content: Any = None,
        auth: bool = True,
        read_timeout: float | _Default | None = _Default.READ,
    ) -> httpx.Request:
        """A request to ``base_url + path``; ``read_timeout`` overrides the read bound."""
        headers = {"User-Agent": f"hutch-python/{__version__}", "Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.config.require_key()}"
            if self.config.project is not None:
                headers["Hutch-Project"] = self.config.project
        timeouts = self.config.timeouts
        timeout = (
            timeouts.as_httpx()
            if isinstance(read_timeout, _Default)
            else timeouts.with_read(read_timeout)
        )
        if content is not None:
            headers["Content-Type"] = "application/octet-stream"
        return httpx.Request(
            method,
            self.config.base_url + path,
            params=list(params or []),
            headers=headers,
            json=json_body,
            content=content,
            extensions={"timeout": timeout},
        )

    def error_from_response(self, response: httpx.Response) -> HutchError:
        """The typed error for a read response with status >= 400."""
        return error_from_body(response.status_code, response.content)

    def transport_error(self, exc: httpx.HTTPError) -> HutchError:
        """Map an httpx failure (no HTTP answer) to a hutch error."""
        url = self.config.base_url
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            return DaemonUnreachable(
                f"cannot reach the hutch daemon at {url} ({exc or type(exc).__name__}); "
                "start it with `make up` or `hutch daemon`, or point HUTCH_URL at it"
            )
        if isinstance(exc, httpx.TimeoutException):
            return Timeout(
                f"the hutch daemon at {url} did not answer in time ({type(exc).__name__}); "
                "pass a larger http_timeout if the operation is expected to take longer"
            )
        if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
            return DaemonUnreachable(
                f"the connection to the hutch daemon at {url} broke ({exc}); "
                "check that the daemon is still running (`hutch daemon` logs)"
            )
        return HutchError(f"request to the hutch daemon at {url} failed: {exc}")

    def body_error(self, exc: httpx.HTTPError) -> HutchError:
        """Map an httpx failure while reading a streamed answer that had begun (a
        download, exec output): the daemon aborts such an answer when it cannot finish
        it, so an incomplete body is an error, never a shorter result."""
        if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError):
            return DaemonUnreachable(
                f"the answer from the hutch daemon at {self.config.base_url} broke off "
                f"before it was complete ({exc}): the daemon cut it (the sandbox was "
                "deleted or its VM stopped, or the daemon restarted); what arrived is "
                "incomplete"
            )
        return self.transport_error(exc)

    def sandbox_path(self, sandbox_id: str, suffix: str = "") -> str:
        """``/v1/sandboxes/{id}`` plus ``suffix``; the id must be a non-empty string."""
        check_path(sandbox_id, "sandbox id")
        return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"

    #: Its older name, still used by ``_pty``.
    _sandbox_path = sandbox_path
