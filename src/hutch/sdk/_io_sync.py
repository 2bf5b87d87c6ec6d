"""The blocking twin of ``_io_async``, written by hand: what the generated shells in
``_sync/`` call where blocking and asyncio code differ."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import websockets.sync.client as ws_client

from hutch.sdk._streams import UploadData, upload_chunks
from hutch.sdk._tar import ChunkReader, extract_tar

__all__ = [
    "OutputCallback",
    "UploadData",
    "WebSocket",
    "call_back",
    "connect_ws",
    "recv_ws",
    "tar_pieces",
    "unpack_tar",
    "upload_body",
]

OutputCallback = Callable[[str], object]
WebSocket = ws_client.ClientConnection


def call_back(callback: OutputCallback, data: str) -> None:
    callback(data)


def upload_body(data: UploadData) -> bytes | Iterator[bytes]:
    return upload_chunks(data)


def tar_pieces(chunks: Iterator[bytes]) -> Iterator[bytes]:
    return chunks


def unpack_tar(stream: Iterator[bytes], local: Any) -> tuple[int, int]:
    """Unpack a downloaded tar stream into ``local`` as it arrives: (members, bytes)."""
    reader = ChunkReader(stream)
    entries = extract_tar(reader, local)  # type: ignore[arg-type]
    return entries, reader.total


def connect_ws(url: str, headers: Mapping[str, str], open_timeout: float | None) -> WebSocket:
    return ws_client.connect(
        url,
        additional_headers=dict(headers),
        open_timeout=open_timeout,
        max_size=None,
        legacy=True,
    )


def recv_ws(ws: WebSocket, timeout: float | None) -> str | bytes:
    """The next frame; TimeoutError after ``timeout`` seconds (None: wait)."""
    return ws.recv(timeout)
