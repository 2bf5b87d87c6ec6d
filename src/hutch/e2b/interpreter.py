"""E2B's code interpreter (port 49999 of a sandbox) on hutch's stateful contexts.

``POST /execute`` answers one JSON object a line, as the E2B server does: ``stdout``/
``stderr`` {text, timestamp (ns)}, ``result`` {text, html, png, ..., is_main_result}
(hutch's ``display`` outputs are results with ``is_main_result`` false, its ``result``
the main one), ``error`` {name, value, traceback}. A run names a context, or runs in the
sandbox's default Python context: its oldest live Python context, made on first use.

``env_vars`` of a run are set in the context's ``os.environ`` for that run and put back
after it (two short runs around the code, as E2B's server does around its kernel's);
per-context variables are the sandbox's ``envVars``. Python is the one language: hutch's
contexts run the image's ``python3`` (the others are refused, naming what is served).
Closing the request (a client-side timeout) interrupts the code.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from hutch.api.streaming import TrackedStream
from hutch.e2b.errors import E2bError
from hutch.e2b.face import read_json, str_map
from hutch.e2b.wiring import Hutch
from hutch.errors import HutchError, NotFound
from hutch.services.interpreter import ContextInfo

__all__ = ["Interpreter", "result_fields"]

log = logging.getLogger(__name__)

LANGUAGES = ("python",)
#: hutch MIME type → the field of E2B's Result.
_MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
_SAVED = "_hutch_e2b_saved_env"


def result_fields(data: dict[str, Any], main: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "result", "is_main_result": main}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        field = _MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        elif field == "json" and isinstance(value, str):
            try:
                out[field] = json.loads(value)
            except ValueError:
                out[field] = value
        else:
            out[field] = value
    if extra:
        out["extra"] = extra
    return out


def e2b_output(item: dict[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type")
    if kind in ("stdout", "stderr"):
        return {"type": kind, "text": item.get("text", ""), "timestamp": time.time_ns()}
    if kind in ("display", "result"):
        return result_fields(item.get("data") or {}, kind == "result")
    if kind == "error":
        traceback = item.get("traceback") or []
        return {
            "type": "error",
            "name": item.get("ename", "Error"),
            "value": item.get("evalue", ""),
            "traceback": "\n".join(traceback) if isinstance(traceback, list) else str(traceback),
        }
    return None


def _set_env_code(env: dict[str, str]) -> str:
    return (
        "import os as _hutch_e2b_os\n"
        f"_hutch_e2b_new_env = {json.dumps(env)}\n"
        f"{_SAVED} = {{k: _hutch_e2b_os.environ.get(k) for k in _hutch_e2b_new_env}}\n"
        "_hutch_e2b_os.environ.update(_hutch_e2b_new_env)\n"
        "del _hutch_e2b_new_env\n"
    )


_RESTORE_ENV_CODE = (
    f"for _hutch_e2b_k, _hutch_e2b_v in {_SAVED}.items():\n"
    "    if _hutch_e2b_v is None:\n"
    "        _hutch_e2b_os.environ.pop(_hutch_e2b_k, None)\n"
    "    else:\n"
    "        _hutch_e2b_os.environ[_hutch_e2b_k] = _hutch_e2b_v\n"
    f"del {_SAVED}\n"
)


def _context_json(ctx: ContextInfo) -> dict[str, str]:
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}


def _language(value: Any) -> str:
    language = value or "python"
    if language not in LANGUAGES:
        raise E2bError(
            400,
            f"language {language!r} is not served: hutch's code interpreter runs Python "
            "contexts (the image's python3); run other languages with sandbox.commands.run",
        )
    return str(language)


class Interpreter:
    def __init__(self, hutch: Hutch) -> None:
        self.hutch = hutch
        self._default_locks: dict[str, asyncio.Lock] = {}

    async def _default_context(self, sandbox_id: str) -> str:
        """The oldest live Python context of the sandbox, made if there is none (one
        at a time, so concurrent first runs share it)."""
        lock = self._default_locks.setdefault(sandbox_id, asyncio.Lock())
        async with lock:
            contexts = [
                c
                for c in await self.hutch.interpreter.list(sandbox_id)
                if c.language == "python" and c.state != "dead"
            ]
            if contexts:
                return min(contexts, key=lambda c: (c.created_at, c.id)).id
            return (await self.hutch.interpreter.create(sandbox_id)).id

    async def _quiet_run(self, sandbox_id: str, context_id: str, code: str) -> None:
        run = await self.hutch.interpreter.run(sandbox_id, context_id, code)
        async for item in run.outputs():
            if item.get("type") == "error":
                raise E2bError(500, f"could not set env_vars in the context: {item.get('evalue')}")

    async def execute(self, sandbox_id: str, request: Request) -> Response:
        body = await read_json(request, required=True)
        code = body.get("code")
        if not isinstance(code, str):
            raise E2bError(400, "code must be a string")
        context_id = body.get("context_id")
        if context_id is not None and not isinstance(context_id, str):
            raise E2bError(400, "context_id must be a string")
        env = str_map(body, "env_vars")
        if context_id is None:
            _language(body.get("language"))
            context_id = await self._default_context(sandbox_id)
        elif body.get("language"):
            raise E2bError(400, "give context_id or language, not both")
        interp = self.hutch.interpreter
        # Each run (the env_vars set, the code, their restore) holds its own lease until
        # its outputs end or it is closed.
        try:
            if env:
                await self._quiet_run(sandbox_id, context_id, _set_env_code(env))
            run = await interp.run(sandbox_id, context_id, code)
        except NotFound as exc:
            raise E2bError(404, exc.message) from exc
        ctx_id = context_id

        async def lines() -> AsyncIterator[bytes]:
            restored = not env
            try:
                try:
                    async for item in run.outputs():
                        out = e2b_output(item)
                        if out is not None:
                            yield json.dumps(out).encode() + b"\n"
                    if env:
                        restored = True
                        await self._quiet_run(sandbox_id, ctx_id, _RESTORE_ENV_CODE)
                except HutchError as exc:
                    error = {"type": "error", "name": type(exc).__name__, "value": exc.message}
                    yield json.dumps({**error, "traceback": ""}).encode() + b"\n"
            finally:
                run.close()
                if not restored:
                    asyncio.get_running_loop().create_task(self._restore_later(sandbox_id, ctx_id))

        return TrackedStream(
            lines(),
            on_close=run.close,
            what=f"code run in {sandbox_id}",
            media_type="application/x-ndjson",
        )

    async def _restore_later(self, sandbox_id: str, context_id: str) -> None:
        """A run cut short (the client went away) still gets its env_vars put back."""
        try:
            await self._quiet_run(sandbox_id, context_id, _RESTORE_ENV_CODE)
        except (HutchError, E2bError) as exc:
            log.warning("could not restore env_vars in %s %s: %s", sandbox_id, context_id, exc)

    async def create_context(self, sandbox_id: str, request: Request) -> JSONResponse:
        body = await read_json(request)
        language = _language(body.get("language"))
        cwd = body.get("cwd")
        if cwd is not None and not isinstance(cwd, str):
            raise E2bError(400, "cwd must be a string")
        ctx = await self.hutch.interpreter.create(sandbox_id, language=language, cwd=cwd)
        return JSONResponse(_context_json(ctx))

    async def list_contexts(self, sandbox_id: str) -> JSONResponse:
        contexts = await self.hutch.interpreter.list(sandbox_id)
        return JSONResponse([_context_json(c) for c in contexts if c.state != "dead"])

    async def remove_context(self, sandbox_id: str, context_id: str) -> Response:
        await self.hutch.interpreter.delete(sandbox_id, context_id)
        return Response(status_code=204)

    async def restart_context(self, sandbox_id: str, context_id: str) -> Response:
        await self.hutch.interpreter.restart(sandbox_id, context_id)
        return Response(status_code=204)
