"""nft scripts applied in-process through libnftables, one context for the daemon's life.

Why not ``nft -f -`` for every script: most of an nft run is making its context (the
library's set-up), not the kernel transaction. Measured on the 2-core host: a policy
swap of one sandbox took 15-24 ms as a new ``nft`` process (and 15 ms through a new
library context), 0.3 ms through a context kept open. A warm-pool hand-out swaps the
pooled VM's ``deny-all`` for the caller's rules on the create's critical path, and
every DNS answer a guest gets adds its addresses the same way.

The same context lists in JSON (:func:`list_json`: ``nft -j list ...``), so reading the
sandboxes' counters every couple of seconds spawns no ``nft`` process either (a fresh
one per read competed with proxied connections and guests for the two cores).

A script still commits as one transaction (``nft_run_cmd_from_buffer`` is what ``nft
-f`` runs), so a refused script changes nothing. The context is not thread-safe: calls
are serialized by a lock and run in a worker thread (:func:`run`), never on an event
loop (the first also opens the library there). Where the library is missing :func:`run`
answers None and the caller runs the ``nft`` program instead (:mod:`hutch.net.nft_apply`).
"""

from __future__ import annotations

import asyncio
import ctypes
import threading

__all__ = ["list_json", "run"]

_LIBRARY = "libnftables.so.1"
#: nftables.h: NFT_CTX_OUTPUT_JSON, the output flag behind ``nft -j``.
_OUTPUT_JSON = 1 << 4

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_ctx: int | None = None
_missing = False


def _load() -> bool:
    """Open the library and make the context once (under ``_lock``); False if missing."""
    global _lib, _ctx, _missing
    if _ctx is not None:
        return True
    if _missing:
        return False
    try:
        lib = ctypes.CDLL(_LIBRARY)
    except OSError:
        _missing = True
        return False
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
    lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
    lib.nft_ctx_output_get_flags.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_output_get_flags.restype = ctypes.c_uint
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    lib.nft_ctx_output_set_flags.restype = None
    ctx = lib.nft_ctx_new(0)  # NFT_CTX_DEFAULT
    if not ctx:
        _missing = True
        return False
    # Output and errors into buffers of the context, not the daemon's stdout/stderr.
    lib.nft_ctx_buffer_output(ctx)
    lib.nft_ctx_buffer_error(ctx)
    _lib, _ctx = lib, ctx
    return True


def _run_locked(script: str) -> tuple[int, str] | None:
    with _lock:
        if not _load():
            return None
        assert _lib is not None and _ctx is not None
        code = _lib.nft_run_cmd_from_buffer(_ctx, script.encode())
        err = _lib.nft_ctx_get_error_buffer(_ctx) or b""
    return code, err.decode(errors="replace")


def _list_locked(command: str) -> tuple[int, str, str] | None:
    with _lock:
        if not _load():
            return None
        assert _lib is not None and _ctx is not None
        _lib.nft_ctx_get_output_buffer(_ctx)  # drop what earlier commands printed
        flags = _lib.nft_ctx_output_get_flags(_ctx)
        _lib.nft_ctx_output_set_flags(_ctx, flags | _OUTPUT_JSON)
        try:
            code = _lib.nft_run_cmd_from_buffer(_ctx, command.encode())
        finally:
            _lib.nft_ctx_output_set_flags(_ctx, flags)
        out = _lib.nft_ctx_get_output_buffer(_ctx) or b""
        err = _lib.nft_ctx_get_error_buffer(_ctx) or b""
    return code, out.decode(errors="replace"), err.decode(errors="replace")


async def list_json(command: str) -> tuple[int, str, str] | None:
    """Run a listing ``command`` (``list counters table inet X``) as ``nft -j`` would, in
    a worker thread; return (code, its JSON output, its error text), or None when this
    host has no libnftables (nothing was run)."""
    return await asyncio.to_thread(_list_locked, command)


async def run(script: str) -> tuple[int, str] | None:
    """Run ``script`` as ``nft -f`` would (one transaction) in a worker thread; return
    (0 or nft's nonzero code, its error text), or None when this host has no
    libnftables (nothing was run)."""
    return await asyncio.to_thread(_run_locked, script)
