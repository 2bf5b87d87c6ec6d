"""Sans-IO handling of streamed bodies, shared by both shells.

Downloads and NDJSON answers (exec output, process output, file watches, code runs)
arrive as byte chunks that a :class:`StreamDecoder` turns into items; uploads are
normalized into chunks so big files stream instead of sitting in memory.
"""

from __future__ import annotations

import io
import json
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any, Generic, Protocol, TypeVar

from hutch.contract.http_errors import error_for
from hutch.errors import InvalidArgument
from hutch.sdk._errors import ProtocolError

__all__ = [
    "CHUNK_SIZE",
    "BytesDecoder",
    "LineDecoder",
    "StreamDecoder",
    "StreamState",
    "UploadData",
    "error_line",
    "upload_chunks",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Upload chunk size: large enough to keep a 100 MiB copy quick, small enough to stream.
CHUNK_SIZE = 1 << 20

#: What ``files.write`` accepts (the asyncio client also takes async iterables/readers).
UploadData = bytes | bytearray | memoryview | str | IO[bytes] | IO[str] | Iterable[bytes]


class StreamDecoder(Protocol[T_co]):
    """Turns a streamed body into items; ``done`` stops reading early."""

    @property
    def done(self) -> bool: ...

    def feed(self, chunk: bytes) -> Sequence[T_co]: ...

    def eof(self) -> Sequence[T_co]:
        """The body ended; raise if that is premature."""
        ...


class BytesDecoder:
    """File downloads: chunks pass through untouched."""

    done = False

    def feed(self, chunk: bytes) -> Sequence[bytes]:
        return [chunk] if chunk else []

    def eof(self) -> Sequence[bytes]:
        return []


def error_line(obj: dict[str, Any], fallback: str) -> Exception:
    """The hutch error an ``{"type": "error", "code", "message"}`` line stands for."""
    code, message = obj.get("code"), obj.get("message")
    return error_for(
        code if isinstance(code, str) else None,
        None,
        message if isinstance(message, str) else f"{fallback}: {obj!r}",
    )


class LineDecoder(Generic[T]):
    """An NDJSON body (one JSON object a line) → items; subclasses say what a line is.

    ``what`` names the stream in messages. ``ended_early``: the ProtocolError message
    when the body ends before :attr:`done` (None: a body may end at any time).
    """

    what = "stream"
    ended_early: str | None = None

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def item(self, obj: Any) -> T | None:
        """The item for one decoded line (None: the line carries none); set
        :attr:`done` on the last one."""
        raise NotImplementedError

    def feed(self, chunk: bytes) -> Sequence[T]:
        self._buffer += chunk
        items: list[T] = []
        while not self.done and (end := self._buffer.find(b"\n")) >= 0:
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            if line and (item := self.item(self._json(line))) is not None:
                items.append(item)
        return items

    def eof(self) -> Sequence[T]:
        rest = bytes(self._buffer).strip()
        self._buffer.clear()
        items: list[T] = []
        parse_rest = rest and not self.done and self.ended_early is not None
        if parse_rest and (item := self.item(self._json(rest))) is not None:
            items.append(item)
        if not self.done and self.ended_early is not None:
            raise ProtocolError(self.ended_early)
        self.done = True
        return items

    def _json(self, line: bytes) -> Any:
        try:
            return json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"{self.what}: not a JSON line: {line[:200]!r}") from exc


class StreamState(Generic[T]):
    """Decoded items waiting to be handed out, in front of a :class:`StreamDecoder`.

    The shells loop: while :attr:`has_item` is false and not :attr:`finished`, read a
    chunk and :meth:`feed` it (or call :meth:`eof`); once :attr:`finished`, the HTTP
    response can be closed even though items may still be queued.
    """

    def __init__(self, decoder: StreamDecoder[T]) -> None:
        self._decoder = decoder
        self._items: deque[T] = deque()
        self._ended = False

    @property
    def has_item(self) -> bool:
        return bool(self._items)

    @property
    def finished(self) -> bool:
        """Nothing more will come from the body (the decoder is done or it ended)."""
        return self._ended or self._decoder.done

    def next_item(self) -> T:
        return self._items.popleft()

    def feed(self, chunk: bytes) -> None:
        self._items.extend(self._decoder.feed(chunk))

    def eof(self) -> None:
        self._ended = True
        self._items.extend(self._decoder.eof())


# -- upload bodies --------------------------------------------------------------------


def encode(chunk: bytes | str | bytearray | memoryview) -> bytes:
    return chunk.encode() if isinstance(chunk, str) else bytes(chunk)


def _read_chunks(reader: IO[Any]) -> Iterator[bytes]:
    while chunk := reader.read(CHUNK_SIZE):
        yield encode(chunk)


def upload_chunks(data: UploadData) -> bytes | Iterator[bytes]:
    """Normalize what ``files.write`` accepts: whole bytes, or an iterator of chunks.

    ``str`` is encoded as UTF-8; a file-like object is read in :data:`CHUNK_SIZE` pieces
    (never all at once), so big files stream.
    """
    if isinstance(data, str | bytes | bytearray | memoryview):
        return encode(data)
    if isinstance(data, io.IOBase) or callable(getattr(data, "read", None)):
        return _read_chunks(data)  # type: ignore[arg-type]
    if isinstance(data, Iterable):
        return (encode(chunk) for chunk in data)
    raise InvalidArgument(
        f"cannot upload a {type(data).__name__}; give bytes, str, a binary file object or "
        "an iterator of bytes"
    )
