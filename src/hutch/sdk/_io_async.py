"""What is asyncio-specific in the asyncio shells, written by hand (``_io_sync`` is its
blocking twin). Everything else of the shells in ``_async/`` is generated into
``_sync/`` by ``scripts/unasync.py``, so it must not import asyncio itself."""

from __future__ import annotations

import asyncio
import inspect
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import websockets.asyncio.client as ws_client

from hutch.sdk._streams import CHUNK_SIZE, UploadData, encode, upload_chunks
from hutch.sdk._tar import extract_tar

__all__ = [
    "AsyncUploadData",
    "OutputCallback",
    "WebSocket",
    "call_back",
    "connect_ws",
    "recv_ws",
    "tar_pieces",
    "unpack_tar",
    "upload_body",
]

#: ``files.write`` on the asyncio client also takes async iterables and async readers.
AsyncUploadData = UploadData | AsyncIterable[bytes] | Any
#: An output callback may be a plain function or a coroutine function.
OutputCallback = Callable[[str], Awaitable[object] | object]
WebSocket = ws_client.ClientConnection


async def call_back(callback: OutputCallback, data: str) -> None:
    outcome = callback(data)
    if inspect.isawaitable(outcome):
        await outcome


def upload_body(data: AsyncUploadData) -> bytes | AsyncIterator[bytes]:
    """Like :func:`hutch.sdk._streams.upload_chunks`, plus async sources; blocking file
    reads run in a worker thread so a big upload does not stall the event loop."""
    if isinstance(data, AsyncIterable):
        return _encode_async(data)
    read = getattr(data, "read", None)
    if callable(read):
        return _read_async(read)
    chunks = upload_chunks(data)
    if isinstance(chunks, bytes):
        return chunks
    return _iter_async(chunks)


async def _encode_async(source: AsyncIterable[Any]) -> AsyncIterator[bytes]:
    async for chunk in source:
        yield encode(chunk)


async def _read_async(read: Callable[[int], Any]) -> AsyncIterator[bytes]:
    is_async = inspect.iscoroutinefunction(read)
    while True:
        chunk = await read(CHUNK_SIZE) if is_async else await asyncio.to_thread(read, CHUNK_SIZE)
        if not chunk:
            return
        yield encode(chunk)


async def _iter_async(chunks: Any) -> AsyncIterator[bytes]:
    for chunk in chunks:
        yield chunk


async def tar_pieces(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    """A tar stream packed by a thread, pulled without blocking the event loop."""
    while True:
        piece = await asyncio.to_thread(next, chunks, None)
        if piece is None:
            return
        yield piece


async def unpack_tar(stream: AsyncIterator[bytes], local: Any) -> tuple[int, int]:
    """Unpack a downloaded tar stream into ``local``: (members, bytes). Spooled to a
    temporary file, then unpacked off the event loop."""
    total = 0
    with tempfile.TemporaryFile() as spool:
        async for chunk in stream:
            total += len(chunk)
            await asyncio.to_thread(spool.write, chunk)
        spool.seek(0)
        entries = await asyncio.to_thread(extract_tar, spool, local)
    return entries, total


async def connect_ws(url: str, headers: Mapping[str, str], open_timeout: float | None) -> WebSocket:
    return await ws_client.connect(
        url, additional_headers=dict(headers), open_timeout=open_timeout, max_size=None
    )


async def recv_ws(ws: WebSocket, timeout: float | None) -> str | bytes:  # noqa: ASYNC109
    """The next frame; TimeoutError after ``timeout`` seconds (None: wait)."""
    if timeout is None:
        return await ws.recv()
    async with asyncio.timeout(timeout):
        return await ws.recv()
