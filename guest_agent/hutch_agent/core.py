"""The Agent: reads frames, dispatches requests to operations, runs the handshake."""

from __future__ import annotations

import base64
import logging
import os
import re
import socket
import time
import traceback
from typing import Any

from hutch_agent import (
    AGENT_VERSION,
    PROTOCOL_VERSION,
    ops_archive,
    ops_contexts,
    ops_exec,
    ops_files,
    ops_process,
    ops_pty,
    ops_sharefs,
    ops_volumes,
    ops_watch,
)
from hutch_agent.errors import AgentError, os_error
from hutch_agent.framing import (
    BULK_MIN,
    CANCEL,
    CREDIT,
    DATA,
    END,
    EOF,
    ERROR,
    REQUEST,
    STALL_S,
    Decoder,
    Frame,
    encode,
)
from hutch_agent.netconfig import apply_network
from hutch_agent.ops import Op
from hutch_agent.streams import Cancelled, Session, Stream
from hutch_agent.system import add_entropy, randomize_addresses, reseed_now, set_clock
from hutch_agent.transport import DeviceTransport, UnixTransport, fill
from hutch_agent.workers import Workers

log = logging.getLogger("hutch-agent")


class Agent:
    def __init__(self, transport: DeviceTransport | UnixTransport, vm_mode: bool) -> None:
        self.transport = transport
        self.vm_mode = vm_mode
        self.decoder = Decoder()
        self.streams = Session()
        self.workers = Workers()
        self.session_nonce: Any = None
        self.applied_net: Any = False  # never equal to a real setting (None included)
        self.ops: dict[str, Op] = {
            **ops_exec.OPS,
            **ops_files.OPS,
            **ops_process.OPS,
            **ops_pty.OPS,
            **ops_watch.OPS,
            **ops_archive.OPS,
            **ops_contexts.OPS,
            **ops_volumes.OPS,
            **ops_sharefs.OPS,
            # Needs the agent's own state (what network it applied), so it lives here.
            "identity": self.identity,
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
        for st in self.streams.reset():
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
            # A frame that stays incomplete while bytes keep coming may be the head of a
            # frame cut off by a host that reconnected before we saw it leave: once a new
            # hello shows up inside it, skip to that hello (see Decoder.skip_to_hello).
            if not self.decoder.pending:
                partial_since = None
            elif frames or partial_since is None:
                partial_since = time.monotonic()  # progress: a new partial frame
            elif time.monotonic() - partial_since > STALL_S:
                partial_since = time.monotonic()  # look again in STALL_S, not per read
                resumed = self.decoder.skip_to_hello()
                if resumed is not None:
                    log.warning("dropped a stale frame head: a new host said hello")
                    frames += resumed
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
                # Its own code, so the host need not read the message (an image older
                # than the host meets ops it does not know).
                self.send_error(f.sid, "unknown_operation", f"unknown operation {op!r}")
            else:
                st = Stream(self, f.sid, self.streams)
                if not self.streams.open(st):
                    self.send_error(f.sid, "invalid_argument", f"stream {f.sid} is in use")
                    return
                handler, header = self.ops[op], f.header
                self.workers.run(lambda: self.serve(st, handler, header), name=f"{op}-{f.sid}")
            return
        cur = self.streams.pop(f.sid) if f.type == CANCEL else self.streams.get(f.sid)
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

    def serve(self, st: Stream, op: Op, header: dict[str, Any]) -> None:
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
            self.streams.close(st)

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

    def identity(self, st: Stream, h: dict[str, Any]) -> dict[str, Any]:
        """A new identity on the session as it is (a pooled VM handed out under a name):
        what a hello with a new nonce takes, in one request, without resetting the
        session's streams. Answers the hostname the guest then has."""
        if self.vm_mode:
            self.take_identity(h)
            set_clock(h.get("time_ns"))
        return {"hostname": os.uname().nodename}

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
        if h.get("aslr") is True:
            randomize_addresses()
        machine_id = h.get("machine_id")
        if isinstance(machine_id, str) and re.fullmatch(r"[0-9a-f]{32}", machine_id):
            try:
                with open("/etc/machine-id", "w") as f:
                    f.write(machine_id + "\n")
            except OSError as exc:
                log.warning("could not write /etc/machine-id: %s", exc)
        # Skipped when unchanged (a daemon restart or a memory resume): re-adding the
        # address would disturb the guest's open connections for nothing.
        if "net" in h and h["net"] != self.applied_net:
            apply_network(h["net"])
            self.applied_net = h["net"]
        name = h.get("hostname")
        if isinstance(name, str) and name:
            try:
                socket.sethostname(name)
            except OSError as exc:
                log.warning("could not set the hostname: %s", exc)
