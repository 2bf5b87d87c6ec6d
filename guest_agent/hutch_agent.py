#!/usr/bin/env python3
"""hutch guest agent: runs inside every sandbox VM as root (tini is PID 1).

Serves protocol v1 (documented in ``src/hutch/guest/protocol.py``; the framing is
mirrored here because this file must run with the Python 3.11 standard library alone)
on the virtio-serial port named ``org.hutch.agent``, found under
``/sys/class/virtio-ports`` and opened read-write once.

Threads: one reader dispatches frames, each request runs in its own thread, and one lock
serialises writes so frames never interleave. The agent never exits on its own: a bad
frame gets an ERROR reply, a lost host resets the session, a failed write is dropped.

``--listen-unix PATH`` (tests only) serves a unix socket instead, one connection at a
time like QEMU's chardev server; the clock and the entropy pool are then left alone,
because that mode runs on the host.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import errno
import fcntl
import glob
import json
import logging
import os
import posixpath
import pwd
import queue
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

AGENT_VERSION = "1.0.0"
PROTOCOL_VERSION = (1, 0)
PORT_NAME = "org.hutch.agent"
HOME = "/root"
log = logging.getLogger("hutch-agent")

# -- framing (mirror of hutch.guest.protocol) -----------------------------------------
MAGIC = b"\x89HUT"
HEADER = struct.Struct(">4sBBHIIII")
PREFIX = struct.Struct(">4sBBHIII")
MAX_FRAME = 1 << 20
CHUNK = 64 * 1024
WINDOW = 16
READ_SIZE = 64 * 1024  # the least room a read gets in the decoder's buffer, bytes
BULK_MIN = 8 * 1024  # a frame missing this many bytes is read in a tight loop
STALL_S = 3.0  # an incomplete frame pending this long, while bytes arrive, is stale
REQUEST, REPLY, DATA, EOF, CREDIT, END, ERROR, CANCEL = range(1, 9)
STDOUT, STDERR = 1, 2


def encode(
    ftype: int,
    sid: int,
    header: dict[str, Any] | None = None,
    payload: bytes = b"",
    channel: int = 0,
) -> bytes:
    head = json.dumps(header, separators=(",", ":")).encode() if header else b""
    prefix = PREFIX.pack(MAGIC, ftype, channel, 0, sid, len(head), len(payload))
    return b"".join((prefix, struct.pack(">I", zlib.crc32(prefix)), head, payload))


class Frame:
    __slots__ = ("channel", "header", "payload", "sid", "type")

    def __init__(
        self, ftype: int, sid: int, header: dict[str, Any], payload: bytes, channel: int
    ) -> None:
        self.type, self.sid, self.header, self.payload, self.channel = (
            ftype,
            sid,
            header,
            payload,
            channel,
        )


class Decoder:
    """Sans-IO decoder; resyncs on the magic. Errors are (stream id | None, message).

    It owns its receive buffer: a transport reads straight into :meth:`space` and calls
    :meth:`commit`; :meth:`feed` copies bytes in for callers that have them already. Why:
    the port hands over one 4 KiB page per read(), and growing and shrinking a bytearray
    by that much per read (plus the copy out of a throw-away read buffer) cost more than
    the read itself; under TCG that capped uploads at ~2.5 MB/s. ``need`` is how many
    buffered bytes the frame at the front needs, so the reads that only carry a frame's
    middle return at once without re-parsing its header.
    """

    def __init__(self) -> None:
        self.buf = bytearray(2 * READ_SIZE)
        self.view = memoryview(self.buf)
        self.start = 0  # first byte not yet parsed
        self.end = 0  # end of the bytes received
        self.need = 0
        self.errors: list[tuple[int | None, str]] = []

    @property
    def pending(self) -> int:
        """Bytes held for an incomplete frame."""
        return self.end - self.start

    def space(self, minimum: int = READ_SIZE) -> memoryview:
        """Free room after the received bytes, at least ``minimum`` bytes long."""
        if len(self.buf) - self.end < minimum:
            pending = self.end - self.start
            size = max(len(self.buf), pending + max(minimum, self.need - pending))
            if size > len(self.buf):
                # A new buffer (never a resize: views of the old one may be alive).
                buf = bytearray(size)
                buf[:pending] = self.view[self.start : self.end]
                self.buf, self.view = buf, memoryview(buf)
            else:
                self.view[:pending] = self.view[self.start : self.end]
            self.start, self.end = 0, pending
        return self.view[self.end :]

    def missing(self) -> int:
        """Bytes the frame at the front still lacks; 0 when none is under way."""
        return max(0, self.need - (self.end - self.start))

    def feed(self, data: bytes | memoryview) -> list[Frame]:
        n = len(data)
        self.space(n)[:n] = data
        return self.commit(n)

    def skip_partial(self) -> list[Frame]:
        """Drop the front byte of a stalled incomplete frame and resync."""
        if self.end > self.start:
            self.start += 1
        self.need = 0
        return self.commit(0)

    def commit(self, n: int) -> list[Frame]:
        """``n`` bytes were written at the front of :meth:`space`; parse what is complete."""
        self.end += n
        end = self.end
        if end - self.start < self.need:
            return []
        self.need = 0
        buf, view = self.buf, self.view
        frames: list[Frame] = []
        pos = self.start
        while True:
            start = buf.find(MAGIC, pos, end)
            if start < 0:
                pos = max(pos, end - len(MAGIC) + 1)
                break
            pos = start
            if end - pos < HEADER.size:
                self.need = HEADER.size
                break
            _m, ftype, channel, _r, sid, hlen, plen, crc = HEADER.unpack_from(buf, pos)
            if zlib.crc32(view[pos : pos + HEADER.size - 4]) != crc:
                pos += 1
                continue
            total = HEADER.size + hlen + plen
            if total > MAX_FRAME:
                self.errors.append((sid, f"frame of {total} bytes exceeds {MAX_FRAME}"))
                pos += 1
                continue
            if end - pos < total:
                self.need = total
                break
            body = pos + HEADER.size
            head, payload = bytes(view[body : body + hlen]), bytes(view[body + hlen : pos + total])
            pos += total
            if not REQUEST <= ftype <= CANCEL:
                self.errors.append((sid, f"unknown frame type {ftype}"))
                continue
            try:
                header = json.loads(head) if hlen else {}
            except ValueError as exc:
                self.errors.append((sid, f"frame header is not JSON: {exc}"))
                continue
            if not isinstance(header, dict):
                self.errors.append((sid, "frame header is not a JSON object"))
                continue
            frames.append(Frame(ftype, sid, header, payload, channel))
        if pos >= end:
            self.start = self.end = 0
        else:
            self.start = pos
        return frames


def fill(transport: DeviceTransport | UnixTransport, decoder: Decoder, size: int) -> int:
    """Read exactly ``size`` bytes into the decoder's free room, or fewer if the
    connection ends first; return how many (the caller commits them)."""
    room = decoder.space(size)[:size]
    read_into = transport.read_into
    got = 0
    while got < size:
        n = read_into(room[got:])
        if not n:
            break
        got += n
    return got


# -- errors and paths -----------------------------------------------------------------
class AgentError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


ERRNO_CODES = {
    errno.ENOENT: "not_found",
    errno.EEXIST: "exists",
    errno.ENOTDIR: "not_a_directory",
    errno.EISDIR: "is_a_directory",
    errno.ENOTEMPTY: "not_empty",
    errno.EACCES: "permission_denied",
    errno.EPERM: "permission_denied",
    errno.EROFS: "permission_denied",
    errno.EINVAL: "invalid_argument",
    errno.ENAMETOOLONG: "invalid_argument",
    errno.ELOOP: "invalid_argument",
}


def os_error(exc: OSError) -> AgentError:
    where = f": {exc.filename!r}" if exc.filename else ""
    return AgentError(ERRNO_CODES.get(exc.errno or 0, "io_error"), f"{exc.strerror}{where}")


FORBIDDEN = ("/proc", "/sys", "/dev")


def normalize(path: Any, home: str = HOME) -> str:
    """Mirror of hutch.guest.paths.normalize_guest_path."""
    if not isinstance(path, str) or not path:
        raise AgentError("invalid_argument", "path is empty")
    if "\0" in path:
        raise AgentError("invalid_argument", f"path {path!r} contains a NUL byte")
    if len(path.encode("utf-8", "surrogateescape")) > 4096:
        raise AgentError("invalid_argument", "path is longer than 4096 bytes")
    if path.startswith("/"):
        full = "/" + posixpath.normpath(path).lstrip("/")
    else:
        full = posixpath.normpath(posixpath.join(home, path))
        if full != home and not full.startswith(home.rstrip("/") + "/"):
            raise AgentError("invalid_argument", f"relative path {path!r} climbs above {home}")
    forbidden_check(full)
    return full


def forbidden_check(full: str) -> None:
    for root in FORBIDDEN:
        if full == root or full.startswith(root + "/"):
            raise AgentError(
                "invalid_argument",
                f"path {full!r} is under {root}, which the file API does not touch",
            )


def checked(path: Any, follow: bool = True) -> str:
    """Normalise and refuse symlinks that lead into the forbidden trees."""
    full = normalize(path)
    if follow:
        forbidden_check(os.path.realpath(full))
    else:
        forbidden_check(
            os.path.join(os.path.realpath(os.path.dirname(full)), os.path.basename(full))
        )
    return full


def entry(path: str, st: os.stat_result | None = None) -> dict[str, Any]:
    st = st or os.lstat(path)
    m = st.st_mode
    kind = (
        "file"
        if stat.S_ISREG(m)
        else "dir"
        if stat.S_ISDIR(m)
        else "symlink"
        if stat.S_ISLNK(m)
        else "other"
    )
    return {
        "name": posixpath.basename(path) or "/",
        "path": path,
        "type": kind,
        "size": st.st_size,
        "mode": stat.S_IMODE(m),
        "mtime": st.st_mtime,
    }


# -- transports -----------------------------------------------------------------------
class DeviceTransport:
    """The virtio-serial port. read() gives b"" at once while no host is connected."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.lock = threading.Lock()

    def read_into(self, room: memoryview) -> int:
        """Read into ``room``; 0 while no host is connected (or the read failed)."""
        try:
            return os.readv(self.fd, [room])
        except OSError as exc:
            log.warning("read from the port failed: %s", exc)
            return 0

    def idle(self) -> None:
        time.sleep(0.05)  # no host: poll() gives POLLHUP, so sleep instead of spinning

    def write(self, data: bytes) -> None:
        # Caller holds self.lock. The port takes at most 32 KiB per write, so loop.
        # While the host is away a write blocks until it returns; errors drop the frame.
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            log.info("dropped a frame: %s", exc)


class UnixTransport:
    """Test transport: a listening unix socket, one connection at a time."""

    def __init__(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        os.chmod(path, 0o600)
        self.server.listen(1)
        self.conn: socket.socket | None = None
        self.lock = threading.Lock()

    def read_into(self, room: memoryview) -> int:
        """Read into ``room``; 0 once the connection closed (the next call accepts)."""
        if self.conn is None:
            conn, _ = self.server.accept()
            with self.lock:
                self.conn = conn
        try:
            n = self.conn.recv_into(room)
        except OSError:
            n = 0
        if not n:
            with self.lock:  # no writer is inside sendall on this socket now
                with contextlib.suppress(OSError):
                    self.conn.shutdown(socket.SHUT_RDWR)
                self.conn.close()
                self.conn = None
        return n

    def idle(self) -> None:
        pass

    def write(self, data: bytes) -> None:
        if self.conn is None:
            return
        try:
            self.conn.sendall(data)
        except OSError as exc:
            log.info("dropped a frame: %s", exc)


def find_port(name: str = PORT_NAME) -> str:
    """Wait for the virtio-serial port named ``name``; return its /dev path."""
    warned = False
    while True:
        for name_file in sorted(glob.glob("/sys/class/virtio-ports/*/name")):
            try:
                with open(name_file) as f:
                    found = f.read().strip()
            except OSError:
                continue
            if found == name:
                return "/dev/" + os.path.basename(os.path.dirname(name_file))
        if not warned:
            log.warning("virtio-serial port %s not found yet; waiting", name)
            warned = True
        time.sleep(0.5)


# -- streams --------------------------------------------------------------------------
class Cancelled(Exception):
    """The host cancelled the stream or went away."""


class Stream:
    def __init__(self, agent: Agent, sid: int) -> None:
        self.agent, self.sid = agent, sid
        self.cond = threading.Condition()
        self.credit = WINDOW
        self.cancelled = False
        self.inbound: queue.Queue[Frame | None] = queue.Queue()
        self.proc: subprocess.Popen[bytes] | None = None
        self.reaped = False

    def send(
        self,
        ftype: int,
        header: dict[str, Any] | None = None,
        payload: bytes = b"",
        channel: int = 0,
    ) -> None:
        self.agent.send(encode(ftype, self.sid, header, payload, channel), self)

    def take_credit(self, deadline: float | None = None) -> bool:
        """Wait for one credit. False if cancelled or the deadline passed first."""
        with self.cond:
            while self.credit <= 0 and not self.cancelled:
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    return False
                self.cond.wait(wait)
            if self.cancelled:
                return False
            self.credit -= 1
            return True

    def grant(self, n: int) -> None:
        with self.cond:
            self.credit += n
            self.cond.notify_all()

    def cancel(self) -> None:
        with self.cond:
            self.cancelled = True
            self.cond.notify_all()
        self.inbound.put(None)

    def inbound_frames(self) -> Any:
        """Yield host DATA payloads until EOF, granting credit back as they are used.

        Raises Cancelled if the host goes away or cancels first.
        """
        consumed = 0
        while True:
            f = self.inbound.get()
            if f is None:
                raise Cancelled()
            if f.type == EOF:
                return
            if f.type == DATA:
                yield f.payload
                consumed += 1
                if consumed >= WINDOW // 2:
                    self.send(CREDIT, {"n": consumed})
                    consumed = 0


# -- the agent ------------------------------------------------------------------------
class Agent:
    def __init__(self, transport: DeviceTransport | UnixTransport, vm_mode: bool) -> None:
        self.transport = transport
        self.vm_mode = vm_mode
        self.decoder = Decoder()
        self.streams: dict[int, Stream] = {}
        self.streams_lock = threading.Lock()
        self.session_nonce: Any = None
        self.ops: dict[str, Callable[[Stream, dict[str, Any]], dict[str, Any] | None]] = {
            "exec": self.op_exec,
            "signal": self.op_signal,
            "read": self.op_read,
            "write": self.op_write,
            "list": self.op_list,
            "stat": self.op_stat,
            "mkdir": self.op_mkdir,
            "remove": self.op_remove,
            "rename": self.op_rename,
        }

    def send(self, data: bytes, stream: Stream | None = None) -> None:
        with self.transport.lock:
            # Checked under the write lock: after a reset no old stream gets a frame out.
            if stream is not None and stream.cancelled:
                return
            self.transport.write(data)

    def send_error(self, sid: int, code: str, message: str) -> None:
        self.send(encode(ERROR, sid, {"code": code, "message": message}))

    def reset_session(self) -> None:
        with self.streams_lock:
            streams, self.streams = list(self.streams.values()), {}
        for st in streams:
            st.cancel()
        self.session_nonce = None

    def run(self) -> None:
        connected = False
        partial_since: float | None = None
        while True:
            # Straight into the decoder's buffer: the port gives one 4 KiB page per
            # read(), so this loop runs 256 times per MiB and must do little.
            n = self.transport.read_into(self.decoder.space())
            if not n:
                if connected:
                    log.info("host disconnected; session reset")
                    connected = False
                    self.reset_session()
                    self.decoder = Decoder()
                    partial_since = None
                self.transport.idle()
                continue
            connected = True
            frames = self.decoder.commit(n)
            missing = self.decoder.missing()
            if missing >= BULK_MIN:
                # The rest of a big frame: read it straight into place, skipping the
                # per-read bookkeeping below (the port gives 4 KiB per read; a 64 KiB
                # DATA frame took 16 trips through this loop).
                frames += self.decoder.commit(fill(self.transport, self.decoder, missing))
            # A frame that stays incomplete while bytes keep coming is the head of a frame
            # cut off by a host that reconnected before we saw it leave: skip past it so
            # it cannot swallow the new host's hello (which is resent every second).
            if not self.decoder.pending:
                partial_since = None
            elif frames or partial_since is None:
                partial_since = time.monotonic()  # progress: a new partial frame
            elif time.monotonic() - partial_since > STALL_S:
                log.warning("dropping a frame stalled for %.0f s", STALL_S)
                partial_since = None
                frames += self.decoder.skip_partial()
            for frame in frames:
                try:
                    self.dispatch(frame)
                except Exception:  # the agent must outlive any frame
                    log.error("dispatch failed:\n%s", traceback.format_exc())
            for sid, message in self.decoder.errors:
                log.warning("bad frame: %s", message)
                self.send_error(sid or 0, "invalid_argument", f"bad frame: {message}")
            self.decoder.errors.clear()

    def dispatch(self, f: Frame) -> None:
        if f.type == REQUEST:
            op = f.header.get("op")
            if op == "hello":
                self.hello(f)
            elif f.sid == 0:
                self.send_error(0, "invalid_argument", "stream 0 only carries hello")
            elif op == "ping":
                self.send(encode(END, f.sid, {"pong": True}))
            elif op not in self.ops:
                self.send_error(f.sid, "invalid_argument", f"unknown operation {op!r}")
            else:
                st = Stream(self, f.sid)
                with self.streams_lock:
                    in_use = f.sid in self.streams
                    if not in_use:
                        self.streams[f.sid] = st
                if in_use:
                    self.send_error(f.sid, "invalid_argument", f"stream {f.sid} is in use")
                    return
                threading.Thread(
                    target=self.serve,
                    args=(st, self.ops[op], f.header),
                    name=f"{op}-{f.sid}",
                    daemon=True,
                ).start()
            return
        with self.streams_lock:
            cur = self.streams.get(f.sid)
            if f.type == CANCEL and cur is not None:
                del self.streams[f.sid]
        if cur is None:
            return  # late frames of a finished stream
        if f.type in (DATA, EOF):
            cur.inbound.put(f)
        elif f.type == CREDIT:
            n = f.header.get("n")
            if isinstance(n, int) and 0 < n <= 1 << 20:
                cur.grant(n)
        elif f.type == CANCEL:
            cur.cancel()

    def serve(
        self, st: Stream, op: Callable[[Stream, dict[str, Any]], Any], header: dict[str, Any]
    ) -> None:
        try:
            result = op(st, header)
            if result is not None:
                st.send(END, result)
        except Cancelled:
            pass
        except AgentError as exc:
            st.send(ERROR, {"code": exc.code, "message": exc.message})
        except OSError as exc:
            err = os_error(exc)
            st.send(ERROR, {"code": err.code, "message": err.message})
        except Exception as exc:
            log.error("%s failed:\n%s", header.get("op"), traceback.format_exc())
            st.send(ERROR, {"code": "internal", "message": f"agent bug: {exc!r}"})
        finally:
            with self.streams_lock:
                if self.streams.get(st.sid) is st:
                    del self.streams[st.sid]

    # -- handshake --------------------------------------------------------------------
    def hello(self, f: Frame) -> None:
        h = f.header
        nonce = h.get("nonce")
        if nonce is None or nonce != self.session_nonce:
            self.reset_session()
            self.session_nonce = nonce
            if self.vm_mode:
                self.take_identity(h)
        if self.vm_mode:
            # Every hello, repeats included: hellos queued while the guest booted carry
            # old times, and the host sends a last fresh one once it has its reply.
            set_clock(h.get("time_ns"))
        uname = os.uname()
        self.send(
            encode(
                END,
                f.sid,
                {
                    "protocol": list(PROTOCOL_VERSION),
                    "agent_version": AGENT_VERSION,
                    "nonce": nonce,
                    "kernel_release": uname.release,
                    "hostname": uname.nodename,
                    "pid": os.getpid(),
                },
            )
        )

    def take_identity(self, h: dict[str, Any]) -> None:
        """Entropy and hostname from the host: clones of one snapshot would otherwise
        share the kernel's RNG state and name."""
        try:
            seed = base64.b64decode(h.get("entropy") or "")
        except ValueError:
            seed = b""
        if seed:
            add_entropy(seed)
            reseed_now()
        machine_id = h.get("machine_id")
        if isinstance(machine_id, str) and re.fullmatch(r"[0-9a-f]{32}", machine_id):
            try:
                with open("/etc/machine-id", "w") as f:
                    f.write(machine_id + "\n")
            except OSError as exc:
                log.warning("could not write /etc/machine-id: %s", exc)
        name = h.get("hostname")
        if isinstance(name, str) and name:
            try:
                socket.sethostname(name)
            except OSError as exc:
                log.warning("could not set the hostname: %s", exc)

    # -- exec -------------------------------------------------------------------------
    def op_exec(self, st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
        argv = h.get("argv")
        if h.get("shell") is not None:
            if not isinstance(h["shell"], str):
                raise AgentError("invalid_argument", "shell must be a string")
            argv = ["/bin/sh", "-c", h["shell"]]
        if (
            not isinstance(argv, list)
            or not argv
            or not all(isinstance(a, str) and "\0" not in a for a in argv)
        ):
            raise AgentError("invalid_argument", "argv must be a non-empty list of strings")
        user = resolve_user(h.get("user"))
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": user.pw_dir,
            "USER": user.pw_name,
            "LOGNAME": user.pw_name,
            "LANG": "C.UTF-8",
            "TERM": "xterm-256color",
        }
        extra = h.get("env") or {}
        if not isinstance(extra, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and "\0" not in k + v and "=" not in k
            for k, v in extra.items()
        ):
            raise AgentError("invalid_argument", "env must map names to strings")
        env.update(extra)
        cwd = h.get("cwd") or (HOME if user.pw_uid == 0 else user.pw_dir)
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise AgentError(
                "not_found", f"working directory {cwd!r} does not exist in the sandbox"
            )
        timeout = h.get("timeout_s")
        if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
            raise AgentError("invalid_argument", "timeout_s must be a positive number")
        ids: dict[str, Any] = {}
        if user.pw_uid != os.geteuid():
            if os.geteuid() != 0:
                raise AgentError("permission_denied", "the agent cannot switch users")
            ids = {
                "user": user.pw_uid,
                "group": user.pw_gid,
                "extra_groups": os.getgrouplist(user.pw_name, user.pw_gid),
            }
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if h.get("stdin") else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
                close_fds=True,
                **ids,
            )
        except FileNotFoundError as exc:
            raise AgentError(
                "command_not_found", f"command not found in the sandbox: {argv[0]!r}"
            ) from exc
        except PermissionError as exc:
            raise AgentError(
                "permission_denied", f"permission denied running {argv[0]!r}: {exc.strerror}"
            ) from exc
        st.proc = proc
        st.send(REPLY, {"event": "started", "pid": proc.pid})
        if proc.stdin is not None:
            threading.Thread(target=pump_stdin, args=(st, proc.stdin), daemon=True).start()
        deadline = None if timeout is None else started + float(timeout)
        timed_out = pump_output(st, proc, deadline)
        rc = proc.returncode
        return {
            "exit_code": rc if rc >= 0 else None,
            "signal": -rc if rc < 0 else None,
            "timed_out": timed_out,
            "duration_ms": int((time.monotonic() - started) * 1000),
        }

    def op_signal(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        signum, target = h.get("signal"), h.get("target")
        if not isinstance(signum, int) or not 0 < signum < signal.NSIG:
            raise AgentError("invalid_argument", f"signal {signum!r} is not a signal number")
        with self.streams_lock:
            other = self.streams.get(target) if isinstance(target, int) else None
        if other is None or other.proc is None:
            raise AgentError("not_found", f"no running command on stream {target!r}")
        with other.cond:  # reaped is set under this lock, so the pgid is still ours
            if other.reaped:
                raise AgentError("not_found", "the command has already exited")
            try:
                os.killpg(other.proc.pid, signum)
            except ProcessLookupError as exc:
                raise AgentError("not_found", "the command has already exited") from exc
        return {}

    # -- files ------------------------------------------------------------------------
    def op_read(self, st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
        path = checked(h.get("path"))
        # O_NONBLOCK so opening a FIFO cannot hang; regular files ignore it.
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            info = os.fstat(fd)
            if stat.S_ISDIR(info.st_mode):
                raise AgentError("is_a_directory", f"{path!r} is a directory; list it instead")
            if not stat.S_ISREG(info.st_mode):
                raise AgentError("invalid_argument", f"{path!r} is not a regular file")
            st.send(REPLY, {"event": "opened", "size": info.st_size})
            total = 0
            while True:
                data = os.read(fd, CHUNK)
                if not data:
                    return {"bytes": total}
                if not st.take_credit():
                    return None
                st.send(DATA, None, data)
                total += len(data)
        finally:
            os.close(fd)

    def op_write(self, st: Stream, h: dict[str, Any]) -> dict[str, Any] | None:
        path = checked(h.get("path"))
        mode = h.get("mode", 0o644)
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise AgentError("invalid_argument", f"mode {mode!r} is not a permission mode")
        parent = posixpath.dirname(path)
        if os.path.isdir(path):
            raise AgentError("is_a_directory", f"{path!r} is a directory")
        try:
            os.makedirs(parent, exist_ok=True)
        except FileExistsError as exc:
            raise AgentError(
                "not_a_directory", f"a parent of {path!r} exists and is not a directory"
            ) from exc
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=".hutch-upload-")
        try:
            try:
                for chunk in st.inbound_frames():
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return {"entry": entry(path)}

    def op_list(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        path = checked(h.get("path"))
        if not os.path.isdir(path):
            os.lstat(path)  # not_found first
            raise AgentError("not_a_directory", f"{path!r} is not a directory")
        with os.scandir(path) as it:
            items = sorted(it, key=lambda e: e.name)
        return {
            "entries": [
                entry(posixpath.join(path, e.name), e.stat(follow_symlinks=False)) for e in items
            ]
        }

    def op_stat(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        return {"entry": entry(checked(h.get("path"), follow=False))}

    def op_mkdir(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        path = checked(h.get("path"))
        mode = h.get("mode", 0o755)
        if not isinstance(mode, int) or not 0 <= mode <= 0o7777:
            raise AgentError("invalid_argument", f"mode {mode!r} is not a permission mode")
        try:
            os.makedirs(path, mode, exist_ok=True)
        except FileExistsError as exc:
            raise AgentError("exists", f"{path!r} exists and is not a directory") from exc
        return {"entry": entry(path)}

    def op_remove(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        path = checked(h.get("path"), follow=False)
        if path == "/":
            raise AgentError("invalid_argument", "refusing to remove /")
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            if h.get("recursive"):
                shutil.rmtree(path)
            else:
                try:
                    os.rmdir(path)
                except OSError as exc:
                    if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                        raise AgentError(
                            "not_empty",
                            f"directory {path!r} is not empty; pass recursive to remove it",
                        ) from exc
                    raise
        else:
            os.unlink(path)
        return {}

    def op_rename(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        source = checked(h.get("source"), follow=False)
        destination = checked(h.get("destination"), follow=False)
        os.rename(source, destination)
        return {"entry": entry(destination)}


def resolve_user(user: Any) -> pwd.struct_passwd:
    try:
        if user is None:
            return pwd.getpwuid(0)
        if isinstance(user, int) or (isinstance(user, str) and user.isdigit()):
            return pwd.getpwuid(int(user))
        if isinstance(user, str):
            return pwd.getpwnam(user)
    except (KeyError, ValueError, OverflowError):  # unknown, NUL byte, uid too big
        pass
    raise AgentError("invalid_argument", f"user {user!r} does not exist in the sandbox")


def pump_stdin(st: Stream, pipe: Any) -> None:
    broken = False
    try:
        for chunk in st.inbound_frames():
            if broken:
                continue  # keep granting credit so the host can finish
            try:
                view = memoryview(chunk)
                while view:
                    view = view[os.write(pipe.fileno(), view) :]
            except OSError:
                broken = True  # the command closed its stdin or exited
    except Cancelled:
        pass
    finally:
        with contextlib.suppress(OSError):
            pipe.close()


def pump_output(st: Stream, proc: subprocess.Popen[bytes], deadline: float | None) -> bool:
    """Stream stdout/stderr as produced until the command exits; return timed_out.

    Output left in the pipes by background children after the command exits is sent if
    it is already there; the stream then ends without waiting for them.
    """
    assert proc.stdout is not None and proc.stderr is not None
    channels = {proc.stdout.fileno(): STDOUT, proc.stderr.fileno(): STDERR}
    poller = select.poll()
    for fd in channels:
        poller.register(fd, select.POLLIN)
    pidfd: int | None
    try:
        pidfd = os.pidfd_open(proc.pid)
        poller.register(pidfd, select.POLLIN)
    except OSError:
        pidfd = None
    exited = timed_out = False

    def kill() -> None:
        nonlocal timed_out
        timed_out = True
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)

    try:
        while channels or not exited:
            if exited:
                wait_ms: float | None = 0
            elif deadline is not None and not timed_out:
                wait_ms = max(0.0, deadline - time.monotonic()) * 1000
            else:
                wait_ms = None
            if pidfd is None and not exited:
                wait_ms = 50 if wait_ms is None else min(wait_ms, 50)
            events = poller.poll(wait_ms)
            if pidfd is None and not exited and proc.poll() is not None:
                exited = True
            if not events:
                if exited:
                    break
                if deadline is not None and not timed_out and time.monotonic() >= deadline:
                    kill()
                continue
            for fd, _ev in events:
                if fd == pidfd:
                    exited = True
                    poller.unregister(fd)
                    continue
                if fd not in channels:
                    continue
                while not st.cancelled and not st.take_credit(None if timed_out else deadline):
                    if not st.cancelled:
                        kill()  # the host stopped reading and the deadline passed
                data = os.read(fd, CHUNK)
                if not data:
                    poller.unregister(fd)
                    del channels[fd]
                    continue
                st.send(DATA, None, data, channels[fd])
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if not exited and proc.poll() is None:
            kill()  # only after an unexpected error: leave no command behind
        with st.cond:
            proc.wait()
            st.reaped = True
        for pipe in (proc.stdout, proc.stderr):
            pipe.close()
    return timed_out


def set_clock(time_ns: Any) -> None:
    """The VM has no RTC: without this its clock starts at 1970 (or at the snapshot's)."""
    if isinstance(time_ns, int) and time_ns > 0:
        try:
            time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        except OSError as exc:
            log.warning("could not set the clock: %s", exc)


RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


def reseed_now() -> None:
    """Make the kernel's CRNG use the pool now (RNDRESEEDCRNG).

    Crediting entropy alone is not enough: Linux 6.1 reseeds on its own schedule (every
    60 s after the first two minutes), so clones of one snapshot would return the same
    /dev/urandom bytes until then.
    """
    try:
        fd = os.open("/dev/urandom", os.O_WRONLY)
    except OSError:
        return
    try:
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    except OSError as exc:
        log.warning("could not reseed the kernel RNG: %s", exc)
    finally:
        os.close(fd)


def add_entropy(seed: bytes) -> None:
    """Credit ``seed`` to the kernel pool (RNDADDENTROPY); else just mix it in."""
    rndaddentropy = 0x40085203  # _IOW('R', 0x03, int[2])
    try:
        fd = os.open("/dev/random", os.O_WRONLY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, rndaddentropy, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
        finally:
            os.close(fd)
        return
    except OSError as exc:
        log.warning("RNDADDENTROPY failed (%s); mixing into /dev/urandom", exc)
    try:
        with open("/dev/urandom", "wb") as f:
            f.write(seed)
    except OSError as exc:
        log.warning("could not seed the RNG: %s", exc)


# glibc copies and clears with `rep movsb`/`rep stosb` from a few KiB up when the CPU
# says ERMS, as QEMU's `-cpu max` does. TCG runs those one byte per loop trip: measured in
# the guest, a 64 KiB memcpy ran at 50 MiB/s this way and at 860 MiB/s with the vector
# loops these thresholds select instead. Every frame the agent moves is copied a few times.
TCG_TUNABLES = (
    "glibc.cpu.x86_rep_movsb_threshold=1073741824:glibc.cpu.x86_rep_stosb_threshold=1073741824"
)


def exec_with_fast_copies() -> None:
    """Under TCG, re-exec this agent once with ``TCG_TUNABLES`` (glibc reads them only at
    start). Commands the agent runs get their own environment, without them. Returns
    when not under TCG, when already done, or when the exec fails."""
    if "GLIBC_TUNABLES" in os.environ:
        return
    try:
        with open("/proc/cpuinfo") as f:
            tcg = "QEMU TCG CPU" in f.read()
    except OSError:
        return
    if not tcg:
        return
    try:
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "GLIBC_TUNABLES": TCG_TUNABLES})
    except OSError as exc:
        log.warning("could not re-exec with faster memory copies: %s", exc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", help="serial port to use instead of discovering it")
    parser.add_argument(
        "--listen-unix",
        metavar="PATH",
        help="tests only: serve a unix socket; clock and RNG left alone",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="hutch-agent: %(levelname)s %(message)s"
    )
    transport: DeviceTransport | UnixTransport
    if not args.listen_unix:
        exec_with_fast_copies()
    if args.listen_unix:
        transport = UnixTransport(args.listen_unix)
    else:
        while True:
            try:
                transport = DeviceTransport(args.device or find_port())
                break
            except OSError as exc:
                log.error("cannot open the agent port: %s; retrying", exc)
                time.sleep(1)
    log.info(
        "agent %s (protocol %d.%d) ready, pid %d", AGENT_VERSION, *PROTOCOL_VERSION, os.getpid()
    )
    Agent(transport, vm_mode=not args.listen_unix).run()


if __name__ == "__main__":
    main()
