"""The sans-IO core shared by the sync and async clients.

Everything that is not I/O lives here: building each API request (as an ``httpx.Request``,
which is plain data), parsing answers and mapping errors (streamed bodies: ``_bodies``). The
shells (``_client.py``, ``_async_client.py``) only send requests and move bytes, so the
two stay in step by construction instead of by copy-paste.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlsplit

import httpx

from hutch.errors import HutchError, InvalidArgument, Timeout
from hutch.models import (
    AUTO_DELETE_S_RANGE,
    AUTO_PAUSE_S_RANGE,
    FORK_COUNT_RANGE,
    PauseMode,
    Shape,
    validate_name,
)
from hutch.sdk._config import ClientConfig
from hutch.sdk._errors import DaemonUnreachable, ProtocolError, error_from_body
from hutch.sdk._net_args import create_fields
from hutch.sdk._types import (
    ExecResult,
    FileEntry,
    Health,
    ImageInfo,
    SandboxInfo,
    SnapshotInfo,
    WrittenFile,
)
from hutch.version import __version__

__all__ = ["Call", "ClientCore"]

T = TypeVar("T")


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request and how to read its successful (status < 400), fully read answer."""

    request: httpx.Request
    parse: Callable[[httpx.Response], T]


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as exc:
        raise ProtocolError(
            f"{response.request.method} {response.request.url.path}: the answer is not "
            f"JSON (HTTP {response.status_code}); is {response.request.url.host} a hutch "
            "daemon?"
        ) from exc


def _list_of(key: str, parse: Callable[[Any], T]) -> Callable[[httpx.Response], list[T]]:
    def reader(response: httpx.Response) -> list[T]:
        body = _json(response)
        items = body.get(key) if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise ProtocolError(f"expected {{{key!r}: [...]}} from {response.request.url.path}")
        return [parse(item) for item in items]

    return reader


def _nothing(response: httpx.Response) -> None:
    return None


def _check_path(path: str, what: str = "path") -> str:
    if not isinstance(path, str) or not path:
        raise InvalidArgument(f"{what} must be a non-empty string, got {path!r}")
    return path


def _pause_mode(mode: str) -> PauseMode:
    try:
        return PauseMode(mode)
    except ValueError:
        choices = ", ".join(repr(m.value) for m in PauseMode)
        raise InvalidArgument(f"pause mode {mode!r} is not one of {choices}") from None


def _fork_count(count: int) -> int:
    lo, hi = FORK_COUNT_RANGE
    if isinstance(count, bool) or not isinstance(count, int) or not lo <= count <= hi:
        raise InvalidArgument(f"fork count={count!r} is out of range; accepted: {lo}-{hi}")
    return count


def _seconds(name: str, value: int | None, bounds: tuple[int, int]) -> int | None:
    lo, hi = bounds
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidArgument(f"{name}={value!r} is out of range; accepted: {lo}-{hi} seconds")
    return value


#: What ``create`` asks for when the caller names no image or shape.
DEFAULT_IMAGE = "base"
_DEFAULT_SHAPE = Shape()


def _from_snapshot_only(image: str, vcpus: int, memory_mib: int, disk_gib: int) -> None:
    """A snapshot fixes the machine: the daemon uses its image and shape and ignores the
    request's. Asking for another one alongside is a mistake worth saying out loud
    rather than quietly booting something else than what was asked for."""
    asked = {
        "image": (image, DEFAULT_IMAGE),
        "vcpus": (vcpus, _DEFAULT_SHAPE.vcpus),
        "memory_mib": (memory_mib, _DEFAULT_SHAPE.memory_mib),
        "disk_gib": (disk_gib, _DEFAULT_SHAPE.disk_gib),
    }
    clashes = [f"{k}={v!r}" for k, (v, default) in asked.items() if v != default]
    if clashes:
        raise InvalidArgument(
            f"a sandbox started from a snapshot gets the snapshot's image and shape; "
            f"drop {', '.join(clashes)} or do not pass snapshot"
        )


def _cmd(cmd: str | Sequence[str]) -> str | list[str]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidArgument("cmd is empty; give a shell string or a list of arguments")
        return cmd
    args = list(cmd)
    if not args or not all(isinstance(a, str) for a in args):
        raise InvalidArgument(f"cmd must be a string or a non-empty list of strings, got {cmd!r}")
    return args


class _Default(enum.Enum):
    READ = "the configured read timeout"


def _is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


class ClientCore:
    """Builds every request of API v1 and reads every answer. No I/O."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config

    @property
    def base_url(self) -> str:
        return self.config.base_url

    @property
    def trust_env(self) -> bool:
        # Never route loopback traffic through an HTTP(S)_PROXY from the environment.
        return not _is_loopback(self.config.base_url)

    # -- plumbing ---------------------------------------------------------------------

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

    def _sandbox_path(self, sandbox_id: str, suffix: str = "") -> str:
        _check_path(sandbox_id, "sandbox id")
        return f"/v1/sandboxes/{quote(sandbox_id, safe='')}{suffix}"

    # -- endpoints --------------------------------------------------------------------

    def health(self) -> Call[Health]:
        req = self.request("GET", "/healthz", auth=False)
        return Call(req, lambda r: Health.from_dict(_json(r)))

    def create_sandbox(
        self,
        image: str,
        *,
        vcpus: int,
        memory_mib: int,
        disk_gib: int,
        env: Mapping[str, str] | None,
        metadata: Mapping[str, str] | None,
        name: str | None,
        timeout_s: int | None,
        auto_resume: bool = False,
        snapshot: str | None = None,
        auto_pause_s: int | None = None,
        auto_delete_s: int | None = None,
        network: str | None = None,
        egress: Sequence[str] | None = None,
        networks: Sequence[str] | None = None,
    ) -> Call[SandboxInfo]:
        """``snapshot``: start from that snapshot id (its image and shape are used, so
        ``image`` and the shape must be left at their defaults). ``auto_pause_s``/
        ``auto_delete_s`` are checked against the daemon's ranges before sending.
        ``network``/``egress``/``networks``: see ``hutch.sdk._net.create_fields``."""
        body: dict[str, Any] = {}
        if snapshot is not None:
            _from_snapshot_only(image, vcpus, memory_mib, disk_gib)
            body["snapshot"] = _check_path(snapshot, "snapshot id")
        else:
            body.update(image=image, vcpus=vcpus, memory_mib=memory_mib, disk_gib=disk_gib)
        if env:
            body["env"] = dict(env)
        if metadata:
            body["metadata"] = dict(metadata)
        if name is not None:
            body["name"] = name
        if timeout_s is not None:
            body["timeout_s"] = timeout_s
        if auto_resume:
            # Sent only when set, so a daemon older than pause/resume still accepts the
            # request (it rejects fields it does not know).
            body["auto_resume"] = True
        # Like auto_resume: sent only when set, for daemons that predate the policies.
        if _seconds("auto_pause_s", auto_pause_s, AUTO_PAUSE_S_RANGE) is not None:
            body["auto_pause_s"] = auto_pause_s
        if _seconds("auto_delete_s", auto_delete_s, AUTO_DELETE_S_RANGE) is not None:
            body["auto_delete_s"] = auto_delete_s
        body.update(create_fields(network, egress, networks))
        req = self.request(
            "POST", "/v1/sandboxes", json_body=body, read_timeout=self.config.timeouts.create
        )
        return Call(req, lambda r: SandboxInfo.from_dict(_json(r)))

    def list_sandboxes(
        self, state: str | None = None, metadata: Mapping[str, str] | None = None
    ) -> Call[list[SandboxInfo]]:
        params: list[tuple[str, str]] = []
        if state is not None:
            params.append(("state", state))
        for key, value in (metadata or {}).items():
            params.append(("metadata", f"{key}={value}"))
        req = self.request("GET", "/v1/sandboxes", params=params)
        return Call(req, _list_of("sandboxes", SandboxInfo.from_dict))

    def get_sandbox(self, sandbox_id: str) -> Call[SandboxInfo]:
        req = self.request("GET", self._sandbox_path(sandbox_id))
        return Call(req, lambda r: SandboxInfo.from_dict(_json(r)))

    def delete_sandbox(self, sandbox_id: str) -> Call[None]:
        return Call(self.request("DELETE", self._sandbox_path(sandbox_id)), _nothing)

    def pause_sandbox(self, sandbox_id: str, mode: str = PauseMode.MEMORY) -> Call[SandboxInfo]:
        """Pause: ``memory`` keeps the running processes, ``disk`` only the disk."""
        body = {"mode": _pause_mode(mode).value}
        req = self.request(
            "POST",
            self._sandbox_path(sandbox_id, "/pause"),
            json_body=body,
            read_timeout=self.config.timeouts.lifecycle,
        )
        return Call(req, lambda r: SandboxInfo.from_dict(_json(r)))

    def resume_sandbox(self, sandbox_id: str) -> Call[SandboxInfo]:
        """Resume a paused sandbox; a running one is left as it is."""
        req = self.request(
            "POST",
            self._sandbox_path(sandbox_id, "/resume"),
            read_timeout=self.config.timeouts.lifecycle,
        )
        return Call(req, lambda r: SandboxInfo.from_dict(_json(r)))

    def fork_sandbox(self, sandbox_id: str, count: int = 1) -> Call[list[SandboxInfo]]:
        """Fork ``count`` children off a sandbox; the answer lists the children only."""
        req = self.request(
            "POST",
            self._sandbox_path(sandbox_id, "/fork"),
            json_body={"count": _fork_count(count)},
            read_timeout=self.config.timeouts.lifecycle,
        )
        return Call(req, _list_of("sandboxes", SandboxInfo.from_dict))

    # -- named snapshots ---------------------------------------------------------------

    def _snapshot_path(self, snapshot_id: str) -> str:
        _check_path(snapshot_id, "snapshot id")
        return f"/v1/snapshots/{quote(snapshot_id, safe='')}"

    def create_snapshot(self, sandbox_id: str, name: str) -> Call[SnapshotInfo]:
        """Snapshot a running or paused sandbox under ``name``; it stays as it was."""
        if not isinstance(name, str):
            raise InvalidArgument(f"snapshot name must be a string, got {name!r}")
        req = self.request(
            "POST",
            self._sandbox_path(sandbox_id, "/snapshots"),
            json_body={"name": validate_name(name)},
            # Saving guest memory and disk takes as long as a pause does.
            read_timeout=self.config.timeouts.lifecycle,
        )
        return Call(req, lambda r: SnapshotInfo.from_dict(_json(r)))

    def list_snapshots(self) -> Call[list[SnapshotInfo]]:
        return Call(
            self.request("GET", "/v1/snapshots"), _list_of("snapshots", SnapshotInfo.from_dict)
        )

    def get_snapshot(self, snapshot_id: str) -> Call[SnapshotInfo]:
        req = self.request("GET", self._snapshot_path(snapshot_id))
        return Call(req, lambda r: SnapshotInfo.from_dict(_json(r)))

    def delete_snapshot(self, snapshot_id: str) -> Call[None]:
        """Delete it, in any order with the sandboxes and snapshots built on it (they
        stay usable; its space is freed when nothing is built on it any more)."""
        return Call(self.request("DELETE", self._snapshot_path(snapshot_id)), _nothing)

    # -- exec -------------------------------------------------------------------------

    def exec_request(
        self,
        sandbox_id: str,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
        timeout_s: float | None = None,
        stream: bool = False,
    ) -> httpx.Request:
        body: dict[str, Any] = {"cmd": _cmd(cmd), "stream": stream}
        if env:
            body["env"] = dict(env)
        if cwd is not None:
            body["cwd"] = cwd
        if user is not None:
            body["user"] = user
        if stdin is not None:
            body["stdin"] = stdin.decode() if isinstance(stdin, bytes) else stdin
        if timeout_s is not None:
            if timeout_s <= 0:
                raise InvalidArgument(f"timeout_s={timeout_s!r} must be > 0 seconds")
            body["timeout_s"] = timeout_s
        # The daemon bounds the command; the HTTP wait only needs to outlast that bound.
        read = self.config.timeouts.read
        read_timeout: float | None = None
        if timeout_s is not None and read is not None:
            read_timeout = timeout_s + read
        return self.request(
            "POST",
            self._sandbox_path(sandbox_id, "/exec"),
            json_body=body,
            read_timeout=read_timeout,
        )

    def exec_call(self, sandbox_id: str, cmd: str | Sequence[str], **kw: Any) -> Call[ExecResult]:
        req = self.exec_request(sandbox_id, cmd, stream=False, **kw)
        return Call(req, lambda r: ExecResult.from_dict(_json(r)))

    def write_file(self, sandbox_id: str, path: str, content: Any, mode: int) -> Call[WrittenFile]:
        if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise InvalidArgument(f"mode={mode!r} must be permission bits such as 0o644")
        params = [("path", _check_path(path)), ("mode", format(mode, "04o"))]
        req = self.request(
            "PUT", self._sandbox_path(sandbox_id, "/files"), params=params, content=content
        )
        return Call(req, lambda r: WrittenFile.from_dict(_json(r)))

    def read_file_request(self, sandbox_id: str, path: str) -> httpx.Request:
        params = [("path", _check_path(path))]
        return self.request("GET", self._sandbox_path(sandbox_id, "/files"), params=params)

    def list_files(self, sandbox_id: str, path: str) -> Call[list[FileEntry]]:
        params = [("path", _check_path(path))]
        req = self.request("GET", self._sandbox_path(sandbox_id, "/files/list"), params=params)
        return Call(req, _list_of("entries", FileEntry.from_dict))

    def stat_file(self, sandbox_id: str, path: str) -> Call[FileEntry]:
        params = [("path", _check_path(path))]
        req = self.request("GET", self._sandbox_path(sandbox_id, "/files/stat"), params=params)
        return Call(req, lambda r: FileEntry.from_dict(_json(r)))

    def mkdir(self, sandbox_id: str, path: str) -> Call[FileEntry]:
        body = {"path": _check_path(path)}
        req = self.request("POST", self._sandbox_path(sandbox_id, "/files/mkdir"), json_body=body)
        return Call(req, lambda r: FileEntry.from_dict(_json(r)))

    def rename(self, sandbox_id: str, source: str, destination: str) -> Call[FileEntry]:
        body = {
            "source": _check_path(source, "source"),
            "destination": _check_path(destination, "destination"),
        }
        req = self.request("POST", self._sandbox_path(sandbox_id, "/files/rename"), json_body=body)
        return Call(req, lambda r: FileEntry.from_dict(_json(r)))

    def remove_file(self, sandbox_id: str, path: str, recursive: bool = False) -> Call[None]:
        params = [("path", _check_path(path)), ("recursive", "true" if recursive else "false")]
        req = self.request("DELETE", self._sandbox_path(sandbox_id, "/files"), params=params)
        return Call(req, _nothing)

    def list_images(self) -> Call[list[ImageInfo]]:
        return Call(self.request("GET", "/v1/images"), _list_of("images", ImageInfo.from_dict))
