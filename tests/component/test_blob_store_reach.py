"""First contact with an S3 endpoint (``S3BlobStore._reach``): one that has not answered
fails a request within ``connect_timeout_s`` with an error naming it, however long
``retry_s`` is; one that answered gets ``retry_s`` when it goes away (a restart) and a
slow one is waited for. Each store here has ``retry_s=600``, beyond the test timeout: a
test that completes proves the request did not wait for it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hutch.errors import BlobError
from hutch.storage.blobs import BlobInfo, S3BlobStore, S3Options
from tests.s3server import BUCKET, S3Server, s3_server

__all__ = ["s3_server"]

PATIENT_S = 600.0  # retry_s: longer than the test timeout (pyproject's 300 s)


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_endpoint_that_never_answered_fails_each_operation_fast(tmp_path: Path) -> None:
    endpoint = f"http://127.0.0.1:{closed_port()}"
    store = S3BlobStore(
        BUCKET,
        "p",
        tmp_path / "j",
        S3Options(
            endpoint=endpoint,
            region="us-east-1",
            retry_s=PATIENT_S,
            connect_timeout_s=1.0,
            access_key="k",
            secret_key="s",
        ),
    )
    src = tmp_path / "src"
    src.write_bytes(b"x" * 100)
    calls: dict[str, Callable[[], object]] = {
        "check": store.check,
        "stat": lambda: store.stat("a/b"),
        "get": lambda: store.get("a/b", tmp_path / "out", expect=BlobInfo("a/b", 100)),
        "put": lambda: store.put("a/b", src),
        "delete": lambda: store.delete("a/b"),
        "list": lambda: store.list_prefix("a/"),
        "abort": lambda: store.abort_uploads(0),
    }
    named = rf"cannot reach the S3 endpoint {endpoint} .*check HUTCH_S3_ENDPOINT"
    for what, call in calls.items():
        with pytest.raises(BlobError, match=named):
            call()
        assert not (tmp_path / "out").exists(), what
    # From worker threads at once, as the daemon calls it: each hears the same.
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(store.stat, f"k/{n}") for n in range(8)]
    for f in futures:
        assert isinstance(f.exception(), BlobError)
        assert endpoint in str(f.exception())


def test_a_server_that_comes_up_later_is_reached(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """The endpoint is not up when the store is opened (a daemon started before its
    MinIO): the first request fails fast, the first one after the server is up works."""
    server = S3Server(tmp_path_factory.mktemp("s3-late"))  # ports picked, not started
    store = server.blob_store(tmp_path / "j", retry_s=PATIENT_S, connect_timeout_s=1.0)
    with pytest.raises(BlobError, match=f"cannot reach the S3 endpoint {server.endpoint} "):
        store.stat("late/blob")
    server.start()
    try:
        src = tmp_path / "src"
        src.write_bytes(b"late but here")
        info = store.put("late/blob", src)
        assert store.stat("late/blob") == BlobInfo("late/blob", len(b"late but here"))
        store.get("late/blob", tmp_path / "out", expect=info)
        assert (tmp_path / "out").read_bytes() == b"late but here"
    finally:
        server.kill()


def test_a_server_that_answered_and_restarts_is_waited_for(
    s3_server: S3Server, tmp_path: Path
) -> None:
    """The endpoint answered; then it is down for longer than the first-contact
    deadline (a restart): a request made meanwhile waits for it (retry_s) and works."""
    store = s3_server.blob_store(tmp_path / "j", retry_s=PATIENT_S, connect_timeout_s=0.5)
    src = tmp_path / "src"
    src.write_bytes(b"before the restart")
    info = store.put("blip/blob", src)
    s3_server.kill()

    def come_back() -> None:
        time.sleep(2.0)  # down for 4x the first-contact deadline
        s3_server.start()

    restarter = threading.Thread(target=come_back)
    restarter.start()
    try:
        assert store.stat("blip/blob") == BlobInfo("blip/blob", info.size)
    finally:
        restarter.join()
    store.get("blip/blob", tmp_path / "out", expect=info)
    assert (tmp_path / "out").read_bytes() == b"before the restart"


class _SlowRelay:
    """A TCP relay to ``target`` that accepts at once and holds each connection
    ``delay_s`` before it forwards anything: a reachable server slow to answer."""

    def __init__(self, target: tuple[str, int], delay_s: float) -> None:
        self.target = target
        self.delay_s = delay_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._stop = threading.Event()
        self._open: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._open.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,))
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        if self._stop.wait(self.delay_s):
            return
        try:
            up = socket.create_connection(self.target)
        except OSError:
            return
        self._open.append(up)
        back = threading.Thread(target=self._pump, args=(up, conn))
        self._threads.append(back)
        back.start()
        self._pump(conn, up)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        for s in [self.sock, *self._open]:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        for t in self._threads:
            t.join(timeout=10)


@pytest.fixture
def slow_relay(s3_server: S3Server) -> Iterator[_SlowRelay]:
    port = int(s3_server.endpoint.rsplit(":", 1)[1])
    relay = _SlowRelay(("127.0.0.1", port), delay_s=2.0)
    try:
        yield relay
    finally:
        relay.close()


def test_a_slow_server_is_not_cut_at_the_first_contact_deadline(
    s3_server: S3Server, slow_relay: _SlowRelay, tmp_path: Path
) -> None:
    """Every connection answers 2 s late, four times the first-contact deadline: the
    connection was accepted, so the request waits (read timeout 60 s) and works."""
    direct = s3_server.blob_store(tmp_path / "j1")
    src = tmp_path / "src"
    src.write_bytes(b"slow but sure")
    info = direct.put("slow/blob", src)
    options = direct.options
    slow = S3BlobStore(
        BUCKET,
        direct.prefix,
        tmp_path / "j2",
        S3Options(
            endpoint=f"http://127.0.0.1:{slow_relay.port}",
            region="us-east-1",
            retry_s=PATIENT_S,
            connect_timeout_s=0.5,
            access_key=options.access_key,
            secret_key=options.secret_key,
        ),
    )
    assert slow.stat("slow/blob") == BlobInfo("slow/blob", info.size)
    slow.get("slow/blob", tmp_path / "out", expect=info)
    assert (tmp_path / "out").read_bytes() == b"slow but sure"
    assert slow_relay.accepted >= 2  # the first contact, then the request itself
