"""Small programs the VM tests start in a guest to see what a pause, resume or fork kept.

Each is a shell command line for ``exec``; each detaches (``setsid -f``) so that it
outlives the exec that started it and the agent's per-command process-group kill.
"""

from __future__ import annotations

# A Python process holding a value in its memory only; it answers on a FIFO: write to
# /tmp/q, read /tmp/a (ASK_HOLDER). /tmp/secret-at-start says it is up.
HOLDER = (
    'mkfifo /tmp/q /tmp/a && setsid -f python3 -c "'
    "import random\n"
    "secret = random.getrandbits(64)\n"
    "open('/tmp/secret-at-start', 'w').write(str(secret))\n"
    "while True:\n"
    "    open('/tmp/q').read()\n"
    "    open('/tmp/a', 'w').write(str(secret))\n"
    '"'
)
HOLDER_UP = "test -e /tmp/secret-at-start && echo y || true"
ASK_HOLDER = "echo x > /tmp/q; cat /tmp/a"

# A TCP listener that keeps a file open from before the pause and appends to it for
# every client: after resume the same socket must accept and the same fd must write.
LISTENER = (
    'setsid -f python3 -c "'
    "import socket\n"
    "log = open('/tmp/served.log', 'a', buffering=1)\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', 7777))\n"
    "s.listen()\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    log.write('served\\n')\n"
    "    c.sendall(b'pong')\n"
    "    c.close()\n"
    '"'
)
PING = (
    'python3 -c "import socket; '
    "print(socket.create_connection(('127.0.0.1', 7777), timeout=10).recv(4).decode())\""
)

# RNDRESEEDCRNG (_IO('R', 0x07)): make the kernel CRNG take in its pool now, so that it
# does not reseed on its own for the next minute (past early boot).
RESEED = (
    'python3 -c \'import fcntl, os; fd = os.open("/dev/random", os.O_WRONLY); '
    "fcntl.ioctl(fd, 0x5207)'"
)
RANDOM_16 = "head -c 16 /dev/urandom | od -An -tx1"
