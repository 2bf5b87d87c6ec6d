"""An in-memory fake of the hutch REST API v1, as an ``httpx.MockTransport``.

For tests of code that uses the SDK (ours and yours): no daemon, no VMs. It follows the
contract's shapes, status codes and error codes; commands do not really run — an
``exec_handler`` decides what each one prints::

    fake = FakeHutch()
    fake.exec_handler = lambda sb, body: FakeRun([("stdout", "hi\\n")], exit_code=0)
    with Sandbox.create(transport=fake.transport, api_key=fake.api_key) as sb:
        assert sb.exec("echo hi").stdout == "hi\\n"

The transport works for both ``Client`` and ``AsyncClient``. Streamed answers keep the
chunk boundaries the handler gives, so decoders are exercised on split lines.

Pause, resume and fork follow the contract too: ``pause`` moves a running sandbox to
``paused`` (any other state: 409 ``invalid_state``); exec and file calls on a paused
sandbox answer 409 ``invalid_state`` unless it was created with ``auto_resume``, which
resumes it first; ``fork`` makes ``count`` running children with ``parent_id`` set and a
copy of the parent's files, and leaves the parent as it was.

Named snapshots: ``POST /v1/sandboxes/{id}/snapshots`` saves a running or paused sandbox's
files (its state is left alone); a create with ``snapshot`` starts from a copy of them,
with the snapshot's image and shape; deleting a snapshot answers 409 ``conflict`` while a
live sandbox's disk is built on it, as in the daemon: one started from it, a fork of
such a one, and the sandbox it was taken of (which runs on from the snapshot). ``auto_pause_s`` and
``auto_delete_s`` are range-checked and reported back, but no clock runs them.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import httpx

from hutch.models import AUTO_DELETE_S_RANGE, AUTO_PAUSE_S_RANGE, NAME_RE

__all__ = ["FakeError", "FakeHutch", "FakeRun", "FakeSandbox", "FakeSnapshot"]

_TIME = "2026-11-30T03:00:00.123Z"
_PAUSED_TIME = "2026-11-30T03:05:00.000Z"
_SNAPSHOT_TIME = "2026-11-30T03:10:00.000Z"
_PAUSE_MODES = ("memory", "disk")
_ENDED = ("destroyed", "failed")
_CREATE_FIELDS = frozenset(
    {
        "image",
        "vcpus",
        "memory_mib",
        "disk_gib",
        "env",
        "metadata",
        "name",
        "timeout_s",
        "auto_resume",
        "snapshot",
        "auto_pause_s",
        "auto_delete_s",
    }
)


@dataclass
class FakeRun:
    """What a faked command does: output chunks in order, then how it ends.

    ``error`` ends the stream with an error line (e.g. ``("timeout", "...")``) and, for
    a non-streamed exec, answers with that error instead.
    """

    output: Sequence[tuple[str, str]] = ()
    exit_code: int | None = 0
    signal: int | None = None
    duration_ms: int = 7
    error: tuple[str, str] | None = None


@dataclass
class FakeSandbox:
    id: str
    spec: dict[str, Any]
    state: str = "running"
    files: dict[str, bytes] = field(default_factory=dict)
    modes: dict[str, int] = field(default_factory=dict)
    dirs: set[str] = field(default_factory=lambda: {"/", "/root", "/tmp"})
    pause_mode: str | None = None
    parent_id: str | None = None
    #: How many times it was resumed (explicitly or by ``auto_resume``).
    resumes: int = 0
    #: Named snapshots its disk is built on. As in the daemon, a snapshotted sandbox
    #: runs on from the snapshot, so it is one of them too; forks inherit them.
    bases: set[str] = field(default_factory=set)

    def pause(self, mode: str) -> None:
        self.state, self.pause_mode = "paused", mode

    def resume(self) -> None:
        self.state, self.pause_mode = "running", None
        self.resumes += 1

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.spec.get("name"),
            "image": self.spec.get("image", "base"),
            "state": self.state,
            "vcpus": self.spec.get("vcpus", 1),
            "memory_mib": self.spec.get("memory_mib", 512),
            "disk_gib": self.spec.get("disk_gib", 4),
            "metadata": self.spec.get("metadata") or {},
            "timeout_s": self.spec.get("timeout_s"),
            "created_at": _TIME,
            "started_at": _TIME,
            "expires_at": None,
            "ended_at": _TIME if self.state == "destroyed" else None,
            "error": None,
            "pause_mode": self.pause_mode,
            "paused_at": _PAUSED_TIME if self.state == "paused" else None,
            "parent_id": self.parent_id,
            "auto_resume": bool(self.spec.get("auto_resume", False)),
            "auto_pause_s": self.spec.get("auto_pause_s"),
            "auto_delete_s": self.spec.get("auto_delete_s"),
            "snapshot_id": self.spec.get("snapshot"),
        }


@dataclass
class FakeSnapshot:
    """A named snapshot: the spec (image and shape) and files of a sandbox at one moment."""

    id: str
    name: str
    sandbox_id: str
    spec: dict[str, Any]
    files: dict[str, bytes]
    modes: dict[str, int]
    dirs: set[str]
    #: The named snapshots the source's disk was already built on.
    bases: set[str] = field(default_factory=set)

    @property
    def size_bytes(self) -> int:
        # Memory image plus the files: deterministic, and grows with what was written.
        memory = int(self.spec.get("memory_mib", 512)) << 20
        return memory + sum(len(data) for data in self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "sandbox_id": self.sandbox_id,
            "image": self.spec.get("image", "base"),
            "vcpus": self.spec.get("vcpus", 1),
            "memory_mib": self.spec.get("memory_mib", 512),
            "disk_gib": self.spec.get("disk_gib", 4),
            "size_bytes": self.size_bytes,
            "created_at": _SNAPSHOT_TIME,
        }


class FakeError(Exception):
    """Raised inside the fake to answer with an API error body."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class _Chunks(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body that yields the given chunks one by one, to sync and async clients."""

    def __init__(self, chunks: Sequence[bytes]) -> None:
        self._chunks = list(chunks)

    def __iter__(self) -> Iterator[bytes]:
        yield from self._chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._chunks:
            yield chunk


def _default_exec(sandbox: FakeSandbox, body: dict[str, Any]) -> FakeRun:
    """``echo`` prints its arguments; anything else echoes its stdin and exits 0."""
    cmd = body["cmd"]
    argv = cmd if isinstance(cmd, list) else ["/bin/sh", "-c", cmd]
    if argv and argv[0] == "echo":
        return FakeRun([("stdout", " ".join(argv[1:]) + "\n")])
    return FakeRun([("stdout", body.get("stdin") or "")] if body.get("stdin") else [])


class FakeHutch:
    """The fake daemon. ``transport`` is the ``httpx.MockTransport`` to pass to clients.

    ``requests`` logs every request received; ``fail_next(...)`` makes the next matching
    request fail with a given error; ``download_chunk`` sets the file download chunk size.
    """

    def __init__(self, api_key: str = "test-key") -> None:
        self.api_key = api_key
        self.sandboxes: dict[str, FakeSandbox] = {}
        self.snapshots: dict[str, FakeSnapshot] = {}
        self.requests: list[httpx.Request] = []
        self.exec_handler: Callable[[FakeSandbox, dict[str, Any]], FakeRun] = _default_exec
        self.images: list[dict[str, Any]] = [
            {
                "name": "base",
                "description": "Debian 12 with Python 3",
                "built": True,
                "digest": "d1g3st",
                "size_bytes": 1 << 30,
                "kernel_release": "6.1.0-cloud",
            },
            {
                "name": "devbox",
                "description": "base plus build tools",
                "built": False,
                "digest": None,
                "size_bytes": None,
                "kernel_release": None,
            },
        ]
        self.download_chunk = 1 << 16
        self._failures: list[tuple[str, str, FakeError]] = []
        self._counter = 0
        self._snapshot_counter = 0
        self.transport = httpx.MockTransport(self._handle)

    # -- test controls ------------------------------------------------------------

    def fail_next(self, method: str, path_re: str, status: int, code: str, message: str) -> None:
        """Answer the next ``method`` request whose path matches ``path_re`` with an error."""
        self._failures.append((method, path_re, FakeError(status, code, message)))

    def add_sandbox(self, **spec: Any) -> FakeSandbox:
        """A running sandbox with the create body ``spec`` (``auto_resume=True`` too).

        With ``snapshot=`` naming a snapshot of this fake, it starts from that snapshot:
        its image, shape and files (an unknown id is just recorded)."""
        self._counter += 1
        source = self.snapshots.get(spec.get("snapshot") or "")
        if source is not None:
            # The snapshot fixes the machine, as in the daemon: its image and shape win.
            spec = {**spec, **source.spec}
        sandbox = FakeSandbox(id=f"sb-{self._counter:012x}", spec={"image": "base", **spec})
        if source is not None:
            sandbox.files, sandbox.modes = dict(source.files), dict(source.modes)
            sandbox.dirs = set(source.dirs)
            sandbox.bases = source.bases | {source.id}
        self.sandboxes[sandbox.id] = sandbox
        return sandbox

    def add_snapshot(self, sandbox: FakeSandbox, name: str) -> FakeSnapshot:
        """A snapshot of ``sandbox`` as it is now (a copy of its files), whatever its state."""
        self._snapshot_counter += 1
        shape = ("image", "vcpus", "memory_mib", "disk_gib")
        snapshot = FakeSnapshot(
            id=f"snap-{self._snapshot_counter:012x}",
            name=name,
            sandbox_id=sandbox.id,
            spec={k: v for k, v in sandbox.spec.items() if k in shape},
            files=dict(sandbox.files),
            modes=dict(sandbox.modes),
            dirs=set(sandbox.dirs),
        )
        snapshot.bases = set(sandbox.bases)
        sandbox.bases.add(snapshot.id)
        self.snapshots[snapshot.id] = snapshot
        return snapshot

    # -- dispatch -----------------------------------------------------------------

    def _handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        try:
            for i, (method, path_re, error) in enumerate(self._failures):
                if method == request.method and re.fullmatch(path_re, request.url.path):
                    del self._failures[i]
                    raise error
            return self._route(request)
        except FakeError as exc:
            return httpx.Response(
                exc.status, json={"error": {"code": exc.code, "message": exc.message}}
            )

    def _route(self, request: httpx.Request) -> httpx.Response:
        path, method = request.url.path, request.method
        if path == "/healthz" and method == "GET":
            return httpx.Response(200, json={"status": "ok", "version": "0.1.0", "accel": "tcg"})
        if request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise FakeError(401, "unauthorized", "missing or wrong API key")
        if path == "/v1/images" and method == "GET":
            return httpx.Response(200, json={"images": self.images})
        if path == "/v1/snapshots" and method == "GET":
            found = [snap.to_json() for snap in self.snapshots.values()]
            return httpx.Response(200, json={"snapshots": found})
        match = re.fullmatch(r"/v1/snapshots/([^/]+)", path)
        if match and method in ("GET", "DELETE"):
            snapshot = self._snapshot(unquote(match.group(1)))
            if method == "GET":
                return httpx.Response(200, json=snapshot.to_json())
            return self._delete_snapshot(snapshot)
        if path == "/v1/sandboxes":
            if method == "POST":
                return self._create(_body(request))
            if method == "GET":
                return self._list(request)
        match = re.fullmatch(r"/v1/sandboxes/([^/]+)(/.*)?", path)
        if match:
            sandbox = self._sandbox(unquote(match.group(1)))
            rest = match.group(2) or ""
            return self._sandbox_route(sandbox, method, rest, request)
        raise FakeError(404, "not_found", f"no route {method} {path}")

    def _sandbox(self, sandbox_id: str) -> FakeSandbox:
        sandbox = self.sandboxes.get(sandbox_id)
        if sandbox is None:
            raise FakeError(404, "not_found", f"sandbox {sandbox_id} does not exist")
        return sandbox

    def _snapshot(self, snapshot_id: str) -> FakeSnapshot:
        snapshot = self.snapshots.get(snapshot_id)
        if snapshot is None:
            raise FakeError(
                404, "not_found", f"no snapshot {snapshot_id!r}; ids look like snap-0123456789ab"
            )
        return snapshot

    def _delete_snapshot(self, snapshot: FakeSnapshot) -> httpx.Response:
        users = sorted(
            sb.id
            for sb in self.sandboxes.values()
            if snapshot.id in sb.bases and sb.state not in _ENDED
        )
        if users:
            raise FakeError(
                409,
                "conflict",
                f"snapshot {snapshot.id} is still needed by sandbox(es) {', '.join(users)}: "
                "their disks are built on it; delete them first",
            )
        del self.snapshots[snapshot.id]
        return httpx.Response(204)

    def _create(self, body: dict[str, Any]) -> httpx.Response:
        if set(body) - _CREATE_FIELDS:
            unknown = set(body) - _CREATE_FIELDS
            raise FakeError(400, "invalid_argument", f"unknown fields {unknown}")
        if not isinstance(body.get("auto_resume", False), bool):
            raise FakeError(400, "invalid_argument", "auto_resume must be true or false")
        for key, (lo, hi) in (
            ("auto_pause_s", AUTO_PAUSE_S_RANGE),
            ("auto_delete_s", AUTO_DELETE_S_RANGE),
        ):
            value = body.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi
            ):
                raise FakeError(
                    400, "invalid_argument", f"{key}={value!r} is out of range; accepted: {lo}-{hi}"
                )
        if body.get("snapshot") is not None:
            self._snapshot(body["snapshot"])  # 404 for an unknown one
            return httpx.Response(201, json=self.add_sandbox(**body).to_json())
        image = body.get("image", "base")
        if image not in {i["name"] for i in self.images}:
            raise FakeError(400, "unknown_image", f"image {image!r} is not in the catalog")
        if not 1 <= body.get("vcpus", 1) <= 8:
            raise FakeError(400, "invalid_argument", "vcpus is out of range; accepted: 1-8")
        return httpx.Response(201, json=self.add_sandbox(**body).to_json())

    def _list(self, request: httpx.Request) -> httpx.Response:
        state = request.url.params.get("state")
        wanted = dict(p.split("=", 1) for p in request.url.params.get_list("metadata"))
        found = [
            sb.to_json()
            for sb in self.sandboxes.values()
            if (sb.state == state if state else sb.state != "destroyed")
            and all((sb.spec.get("metadata") or {}).get(k) == v for k, v in wanted.items())
        ]
        return httpx.Response(200, json={"sandboxes": found})

    def _sandbox_route(
        self, sb: FakeSandbox, method: str, rest: str, request: httpx.Request
    ) -> httpx.Response:
        if rest == "" and method == "GET":
            return httpx.Response(200, json=sb.to_json())
        if rest == "" and method == "DELETE":
            sb.state, sb.pause_mode = "destroyed", None
            return httpx.Response(204)
        if method == "POST" and rest in ("/pause", "/resume", "/fork"):
            return self._lifecycle(sb, rest, request)
        if method == "POST" and rest == "/snapshots":
            name = _body(request).get("name")
            if not isinstance(name, str) or not NAME_RE.match(name):
                raise FakeError(
                    400,
                    "invalid_argument",
                    f"name={name!r} is not valid; use 1-63 lowercase letters, digits and '-'",
                )
            _require(sb, "running", "paused")
            return httpx.Response(201, json=self.add_snapshot(sb, name).to_json())
        if sb.state == "paused" and sb.spec.get("auto_resume"):
            sb.resume()
        _require(sb, "running")
        if rest == "/exec" and method == "POST":
            return self._exec(sb, _body(request))
        return self._files(sb, method, rest, request)

    def _lifecycle(self, sb: FakeSandbox, rest: str, request: httpx.Request) -> httpx.Response:
        body = _body(request)
        if rest == "/pause":
            mode = body.get("mode", "memory")
            if mode not in _PAUSE_MODES:
                raise FakeError(400, "invalid_argument", f"mode {mode!r} is not memory or disk")
            _require(sb, "running")
            sb.pause(mode)
            return httpx.Response(200, json=sb.to_json())
        if rest == "/resume":
            if sb.state != "running":  # resuming a running sandbox is a no-op
                _require(sb, "paused", "running")
                sb.resume()
            return httpx.Response(200, json=sb.to_json())
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 100:
            raise FakeError(400, "invalid_argument", f"count={count!r} is out of range; 1-100")
        _require(sb, "running", "paused")
        children = []
        for _ in range(count):
            child = self.add_sandbox(**{k: v for k, v in sb.spec.items() if k != "name"})
            child.parent_id = sb.id
            child.files, child.modes = dict(sb.files), dict(sb.modes)
            child.dirs = set(sb.dirs)
            child.bases = set(sb.bases)
            children.append(child.to_json())
        return httpx.Response(201, json={"sandboxes": children})

    def _exec(self, sb: FakeSandbox, body: dict[str, Any]) -> httpx.Response:
        cmd = body.get("cmd")
        if not (isinstance(cmd, str) or (isinstance(cmd, list) and cmd)):
            raise FakeError(400, "invalid_argument", "cmd must be a string or a list")
        run = self.exec_handler(sb, body)
        if not body.get("stream"):
            if run.error:
                code, message = run.error
                raise FakeError(504 if code == "timeout" else 500, code, message)
            out = "".join(d for s, d in run.output if s == "stdout")
            err = "".join(d for s, d in run.output if s == "stderr")
            return httpx.Response(
                200,
                json={
                    "exit_code": run.exit_code,
                    "signal": run.signal,
                    "stdout": out,
                    "stderr": err,
                    "duration_ms": run.duration_ms,
                },
            )
        lines: list[dict[str, Any]] = [{"type": s, "data": d} for s, d in run.output]
        if run.error:
            lines.append({"type": "error", "code": run.error[0], "message": run.error[1]})
        else:
            lines.append(
                {
                    "type": "exit",
                    "exit_code": run.exit_code,
                    "signal": run.signal,
                    "duration_ms": run.duration_ms,
                }
            )
        encoded = [(json.dumps(line) + "\n").encode() for line in lines]
        # Split every line in two so clients must reassemble lines across chunks.
        chunks = [part for line in encoded for part in (line[:5], line[5:])]
        return httpx.Response(
            200, headers={"content-type": "application/x-ndjson"}, stream=_Chunks(chunks)
        )

    def _files(
        self, sb: FakeSandbox, method: str, rest: str, request: httpx.Request
    ) -> httpx.Response:
        params = request.url.params
        if rest in ("/files/mkdir", "/files/rename") and method == "POST":
            body = _body(request)
            if rest == "/files/mkdir":
                path = _abs(body["path"])
                parts = path.strip("/").split("/")
                for i in range(1, len(parts) + 1):
                    sb.dirs.add("/" + "/".join(parts[:i]))
                return httpx.Response(200, json=_entry(sb, path))
            src, dst = _abs(body["source"]), _abs(body["destination"])
            if src not in sb.files:
                raise FakeError(404, "not_found", f"{src}: no such file")
            sb.files[dst] = sb.files.pop(src)
            sb.modes[dst] = sb.modes.pop(src, 0o644)
            return httpx.Response(200, json=_entry(sb, dst))
        path = _abs(params.get("path") or "")
        if rest == "/files" and method == "PUT":
            if posixpath.dirname(path) not in sb.dirs:
                raise FakeError(404, "not_found", f"{posixpath.dirname(path)}: no such directory")
            if path in sb.dirs:
                raise FakeError(400, "invalid_argument", f"{path} is a directory")
            sb.files[path] = request.content
            sb.modes[path] = int(params.get("mode", "0644"), 8)
            return httpx.Response(200, json={"path": path, "size": len(request.content)})
        if rest == "/files" and method == "GET":
            if path not in sb.files:
                kind = "is a directory" if path in sb.dirs else "no such file"
                raise FakeError(
                    400 if path in sb.dirs else 404,
                    "invalid_argument" if path in sb.dirs else "not_found",
                    f"{path}: {kind}",
                )
            data, n = sb.files[path], self.download_chunk
            chunks = [data[i : i + n] for i in range(0, len(data), n)]
            return httpx.Response(
                200, headers={"content-type": "application/octet-stream"}, stream=_Chunks(chunks)
            )
        if rest == "/files/list" and method == "GET":
            if path not in sb.dirs:
                raise FakeError(404, "not_found", f"{path}: no such directory")
            children = sorted(
                p
                for p in (sb.files.keys() | sb.dirs)
                if p != "/" and posixpath.dirname(p) == path and p != path
            )
            return httpx.Response(200, json={"entries": [_entry(sb, p) for p in children]})
        if rest == "/files/stat" and method == "GET":
            return httpx.Response(200, json=_entry(sb, path))
        if rest == "/files" and method == "DELETE":
            if path in sb.files:
                del sb.files[path]
            elif path in sb.dirs:
                inside = [p for p in sb.files.keys() | sb.dirs if p.startswith(path + "/")]
                if inside and params.get("recursive") != "true":
                    raise FakeError(
                        409,
                        "conflict",
                        f"directory {path!r} is not empty; pass recursive to remove it",
                    )
                for p in inside:
                    sb.files.pop(p, None)
                    sb.dirs.discard(p)
                sb.dirs.discard(path)
            else:
                raise FakeError(404, "not_found", f"{path}: no such file or directory")
            return httpx.Response(204)
        raise FakeError(404, "not_found", f"no route {method} {rest}")


def _require(sb: FakeSandbox, *states: str) -> None:
    if sb.state not in states:
        raise FakeError(
            409,
            "invalid_state",
            f"sandbox {sb.id} is {sb.state}; this needs it to be {' or '.join(states)}",
        )


def _body(request: httpx.Request) -> dict[str, Any]:
    try:
        body = json.loads(request.content or b"{}")
    except ValueError as exc:
        raise FakeError(400, "invalid_argument", f"body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise FakeError(400, "invalid_argument", "body must be a JSON object")
    return body


def _abs(path: str) -> str:
    if not path:
        raise FakeError(400, "invalid_argument", "path is required")
    return posixpath.normpath(posixpath.join("/root", path))


def _entry(sb: FakeSandbox, path: str) -> dict[str, Any]:
    if path in sb.dirs:
        kind, size, mode = "dir", 4096, 0o755
    elif path in sb.files:
        kind, size, mode = "file", len(sb.files[path]), sb.modes.get(path, 0o644)
    else:
        raise FakeError(404, "not_found", f"{path}: no such file or directory")
    return {
        "name": posixpath.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": size,
        "mode": format(mode, "04o"),
        "mtime": _TIME,
    }
