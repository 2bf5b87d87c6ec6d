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


Modules: framing (protocol v1 frames), transport (the port), streams (per-request
flow control), core (the Agent: dispatch and handshake), ops_exec / ops_files (the
operations), system (clock, entropy), __main__ (entry point). Shared volumes:
ops_sharefs (the mount and its /dev/fuse loop), fuse_fs (FUSE requests to file calls),
fuse_proto (the kernel's FUSE structs), sharefs_client and sharefs_wire (the channel to
hutchd; the wire module is a copy of ``src/hutch/storage/sharefs_wire.py``).
"""

from __future__ import annotations

AGENT_VERSION = "1.0.0"
PROTOCOL_VERSION = (1, 0)
PORT_NAME = "org.hutch.agent"
HOME = "/root"
