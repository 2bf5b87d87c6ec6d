"""Sans-IO handling of streamed bodies, shared by both shells.

Downloads and exec output arrive as byte chunks that a :class:`StreamDecoder` turns into
items (NDJSON exec events, or file chunks as they are); uploads are normalized into
chunks so big files stream instead of sitting in memory.
"""

from __future__ import annotations

import io
import json
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import IO, Any, Generic, Protocol, TypeVar

from hutch.errors import InvalidArgument
from hutch.sdk._errors import ProtocolError, error_for
from hutch.sdk._types import ExecEvent, ExecExit, ExecOutput, ExecResult

__all__ = [
    "CHUNK_SIZE",
    "BytesDecoder",
    "ExecCollector",
    "ExecEventDecoder",
    "StreamDecoder",
    "StreamState",
    "UploadData",
    "sync_upload_chunks",
]

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: Upload chunk size: large enough to keep a 100 MiB copy quick, small enough to stream.
CHUNK_SIZE = 1 << 20

#: What ``files.write`` accepts (the async client also takes async iterables/readers).
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


class ExecEventDecoder:
    """NDJSON exec events → :class:`ExecOutput` ... :class:`ExecExit`.

    An ``error`` line raises the mapped hutch error (e.g. ``Timeout``); a body that ends
    before the exit event raises :class:`ProtocolError`.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self.done = False

    def feed(self, chunk: bytes) -> Sequence[ExecEvent]:
        self._buffer += chunk
        events: list[ExecEvent] = []
        while not self.done:
            end = self._buffer.find(b"\n")
            if end < 0:
                break
            line = bytes(self._buffer[:end]).strip()
            del self._buffer[: end + 1]
            if line:
                events.append(self._event(line))
        return events

    def eof(self) -> Sequence[ExecEvent]:
        events: list[ExecEvent] = []
        rest = bytes(self._buffer).strip()
        self._buffer.clear()
        if rest and not self.done:
            events.append(self._event(rest))
        if not self.done:
            raise ProtocolError(
                "the exec stream ended before the command's exit event; the daemon may "
                "have restarted or the connection dropped"
            )
        return events

    def _event(self, line: bytes) -> ExecEvent:
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise ProtocolError(f"exec stream: not a JSON line: {line[:200]!r}") from exc
        kind = obj.get("type") if isinstance(obj, dict) else None
        if kind in ("stdout", "stderr"):
            data = obj.get("data")
            if not isinstance(data, str):
                raise ProtocolError(f"exec stream: {kind} event without string data: {obj!r}")
            return ExecOutput(kind, data)
        if kind == "exit":
            self.done = True
            code, sig, ms = obj.get("exit_code"), obj.get("signal"), obj.get("duration_ms")
            if not all(
                v is None or (isinstance(v, int) and not isinstance(v, bool))
                for v in (code, sig, ms)
            ):
                raise ProtocolError(f"exec stream: malformed exit event {obj!r}")
            return ExecExit(exit_code=code, signal=sig, duration_ms=ms or 0)
        if kind == "error":
            self.done = True
            message = obj.get("message")
            raise error_for(
                obj.get("code") if isinstance(obj.get("code"), str) else None,
                None,
                message if isinstance(message, str) else f"exec failed: {obj!r}",
            )
        raise ProtocolError(f"exec stream: unknown event {obj!r}")


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


class ExecCollector:
    """Accumulates streamed events into the :class:`ExecResult` a plain exec returns."""

    def __init__(self) -> None:
        self._out: list[str] = []
        self._err: list[str] = []
        self._exit: ExecExit | None = None

    def add(self, event: ExecEvent) -> None:
        if isinstance(event, ExecExit):
            self._exit = event
        elif event.stream == "stdout":
            self._out.append(event.data)
        else:
            self._err.append(event.data)

    def result(self) -> ExecResult:
        if self._exit is None:
            raise ProtocolError("the exec stream ended without an exit event")
        return ExecResult(
            exit_code=self._exit.exit_code,
            signal=self._exit.signal,
            stdout="".join(self._out),
            stderr="".join(self._err),
            duration_ms=self._exit.duration_ms,
        )


# -- upload bodies --------------------------------------------------------------------


def _encode(chunk: bytes | str | bytearray | memoryview) -> bytes:
    return chunk.encode() if isinstance(chunk, str) else bytes(chunk)


def _read_chunks(reader: IO[Any]) -> Iterator[bytes]:
    while chunk := reader.read(CHUNK_SIZE):
        yield _encode(chunk)


def sync_upload_chunks(data: UploadData) -> bytes | Iterator[bytes]:
    """Normalize what ``files.write`` accepts: whole bytes, or an iterator of chunks.

    ``str`` is encoded as UTF-8; a file-like object is read in :data:`CHUNK_SIZE` pieces
    (never all at once), so big files stream.
    """
    if isinstance(data, str | bytes | bytearray | memoryview):
        return _encode(data)
    if isinstance(data, io.IOBase) or callable(getattr(data, "read", None)):
        return _read_chunks(data)  # type: ignore[arg-type]
    if isinstance(data, Iterable):
        return (_encode(chunk) for chunk in data)
    raise InvalidArgument(
        f"cannot upload a {type(data).__name__}; give bytes, str, a binary file object or "
        "an iterator of bytes"
    )
