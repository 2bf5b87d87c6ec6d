"""The fake's in-memory filesystem: the ``/v1/sandboxes/{id}/files...`` routes of
:class:`hutch.testing.FakeHutch`."""

from __future__ import annotations

import posixpath
from typing import Any

import httpx

from hutch.contract.limits import DEFAULT_FILE_MODE
from hutch.errors import Conflict, InvalidArgument, NotFound
from hutch.testing._state import TIME, Chunks, FakeSandbox, json_body

__all__ = ["files_route"]


def files_route(
    sb: FakeSandbox, method: str, rest: str, request: httpx.Request, download_chunk: int
) -> httpx.Response:
    """Answer a ``/files...`` request of sandbox ``sb`` from its in-memory files;
    downloads come in ``download_chunk``-byte chunks."""
    params = request.url.params
    if rest in ("/files/mkdir", "/files/rename") and method == "POST":
        body = json_body(request)
        if rest == "/files/mkdir":
            path = _abs(_field(body, "path"))
            _make_parents(sb, path)
            sb.dirs.add(path)
            return httpx.Response(200, json=_entry(sb, path))
        src, dst = _abs(_field(body, "source")), _abs(_field(body, "destination"))
        if src not in sb.files:
            raise NotFound(f"{src}: no such file")
        sb.files[dst] = sb.files.pop(src)
        sb.modes[dst] = sb.modes.pop(src, DEFAULT_FILE_MODE)
        return httpx.Response(200, json=_entry(sb, dst))
    path = _abs(params.get("path") or "")
    if rest == "/files" and method == "PUT":
        if any(p in sb.files for p in _parents(path)):
            raise InvalidArgument(f"a parent of {path!r} exists and is not a directory")
        if path in sb.dirs:
            raise InvalidArgument(f"{path} is a directory")
        _make_parents(sb, path)  # as the guest agent does
        sb.files[path] = request.content
        sb.modes[path] = int(params.get("mode") or format(DEFAULT_FILE_MODE, "o"), 8)
        return httpx.Response(200, json={"path": path, "size": len(request.content)})
    if rest == "/files" and method == "GET":
        if path not in sb.files:
            kind = "is a directory" if path in sb.dirs else "no such file"
            raise (InvalidArgument if path in sb.dirs else NotFound)(f"{path}: {kind}")
        data, n = sb.files[path], download_chunk
        chunks = [data[i : i + n] for i in range(0, len(data), n)]
        return httpx.Response(
            200, headers={"content-type": "application/octet-stream"}, stream=Chunks(chunks)
        )
    if rest == "/files/list" and method == "GET":
        if path not in sb.dirs:
            raise NotFound(f"{path}: no such directory")
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
                raise Conflict(
                    f"directory {path!r} is not empty; pass recursive to remove it",
                )
            for p in inside:
                sb.files.pop(p, None)
                sb.dirs.discard(p)
            sb.dirs.discard(path)
        else:
            raise NotFound(f"{path}: no such file or directory")
        return httpx.Response(204)
    raise NotFound(f"no route {method} {rest}")


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidArgument(f"{name}: Field required")
    return value


def _parents(path: str) -> list[str]:
    parts = path.strip("/").split("/")[:-1]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _make_parents(sb: FakeSandbox, path: str) -> None:
    sb.dirs.update(_parents(path))


def _abs(path: str) -> str:
    if not path:
        raise InvalidArgument("path is required")
    return posixpath.normpath(posixpath.join("/root", path))


def _entry(sb: FakeSandbox, path: str) -> dict[str, Any]:
    if path in sb.dirs:
        kind, size, mode = "dir", 4096, 0o755
    elif path in sb.files:
        kind, size, mode = "file", len(sb.files[path]), sb.modes.get(path, DEFAULT_FILE_MODE)
    else:
        raise NotFound(f"{path}: no such file or directory")
    return {
        "name": posixpath.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": size,
        "mode": format(mode, "04o"),
        "mtime": TIME,
    }
