"""The fake's in-memory filesystem: the ``/v1/sandboxes/{id}/files...`` routes of
:class:`hutch.sdk.testing.FakeHutch`."""

from __future__ import annotations

import posixpath
from typing import Any

import httpx

from hutch.sdk._fake_state import TIME, Chunks, FakeError, FakeSandbox, json_body

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
        data, n = sb.files[path], download_chunk
        chunks = [data[i : i + n] for i in range(0, len(data), n)]
        return httpx.Response(
            200, headers={"content-type": "application/octet-stream"}, stream=Chunks(chunks)
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
        "mtime": TIME,
    }
