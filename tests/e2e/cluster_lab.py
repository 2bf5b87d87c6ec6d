"""Bring-up of a hutch cluster on this machine for e2e tests: N hutchd workers sharing
one PostgreSQL database (``tests/pgserver.py``), one cluster secret, one admin key and
one secrets key, and (optionally) one S3 bucket (``tests/s3server.py``) as the blob store
through which pause files, overlays and snapshots move between hosts.

    from tests.e2e.cluster_lab import Worker, cluster_of, owners

    @pytest.fixture(scope="module")
    def cluster(base_image, tmp_path_factory, s3_server) -> Iterator[list[Worker]]:
        with cluster_of(tmp_path_factory.mktemp("c"), ("w1", "w2"), s3=s3_server) as ws:
            yield ws

Each worker has its own state dir, port and address pool (the e2e ``Daemon``'s); on
exit every worker is finalized (its sandboxes deleted, no QEMU or file left) and a
leftover fails the caller.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import socket
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path

from hutch.config import load_settings
from hutch.sdk import SandboxInfo
from tests import pgserver
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon, free_port
from tests.s3server import S3Server

__all__ = ["LEASE_S", "MEMORY_MIB", "Worker", "cluster_of", "create_on", "owners"]

#: A short lease so that a killed worker is marked down within seconds.
LEASE_S = 5.0
#: Every test sandbox's memory (small: several per worker on a 2-core machine).
MEMORY_MIB = 128


class Worker(Daemon):
    """A hutchd in the worker role of a test cluster."""

    def __init__(
        self,
        state_dir: Path,
        host_id: str,
        shared: Path,
        database: str,
        *,
        labels: str = "",
        extra_env: Mapping[str, str] | None = None,
        tunnel_port: int = 0,
    ) -> None:
        super().__init__(state_dir)
        self.host_id = host_id
        self.daemon_env.update(
            {
                # Private networks across hosts: each worker's own UDP port (0: off).
                "HUTCH_TUNNEL_PORT": str(tunnel_port),
                "HUTCH_ROLE": "worker",
                "HUTCH_HOST_ID": host_id,
                "HUTCH_HOST_LABELS": labels,
                "HUTCH_HOST_LEASE_S": str(LEASE_S),
                "HUTCH_DATABASE_URL": database,
                "HUTCH_CLUSTER_SECRET_FILE": str(shared / "cluster-secret"),
                **(extra_env or {}),
            }
        )
        self.settings = load_settings(self.daemon_env)

    @property
    def tunnel(self) -> str:
        """This worker's overlay device (hutch.net.tunnel), there while it routes."""
        return f"hx{self.settings.daemon_tag}"

    @property
    def route_table(self) -> str:
        return str(0x68780000 | int(self.settings.daemon_tag, 16))

    @property
    def e2b_url(self) -> str | None:
        """This worker's E2B face (``cluster_of(..., e2b=True)``), else None."""
        listen = self.daemon_env.get("HUTCH_E2B_LISTEN")
        return f"http://{listen}" if listen else None

    def blob_keys(self, s3: S3Server, under: str) -> list[str]:
        """Keys (relative to this worker's ``HUTCH_BLOB_URL`` prefix) under ``under``."""
        url = self.daemon_env["HUTCH_BLOB_URL"]
        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        listed = s3.client().list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{under}")
        return sorted(o["Key"][len(prefix) + 1 :] for o in listed.get("Contents", []))

    def pause_uploaded(
        self, s3: S3Server, sandbox_id: str, paused_at: datetime | None = None
    ) -> bool:
        """The upload of a pause of the sandbox is complete (its index is there); with
        ``paused_at`` (its view's), of that pause (an earlier one's blobs may linger
        a moment after its resume: they are removed in the background)."""
        since = -1 if paused_at is None else int(paused_at.timestamp() * 1000) - 1
        return any(
            k.endswith("/index.json") and int(k.split("/")[2]) >= since
            for k in self.blob_keys(s3, f"pauses/{sandbox_id}/")
        )


@contextlib.contextmanager
def cluster_of(
    root: Path,
    host_ids: Sequence[str],
    *,
    labels: Mapping[str, str] | None = None,
    s3: S3Server | None = None,
    extra_env: Mapping[str, str] | None = None,
    tunnel: bool = False,
    e2b: bool = False,
) -> Iterator[list[Worker]]:
    """Workers ``host_ids`` started under ``root`` (their blobs in ``s3`` when given,
    all under one prefix of its bucket; each with its E2B face on a port of its own
    when ``e2b``, all with one token secret; with ``tunnel``, private networks across
    them, each worker on a UDP port of its own); finalized on exit."""
    shared = root / "shared"
    shared.mkdir(parents=True)
    (shared / "cluster-secret").write_text(secrets.token_hex(32) + "\n")
    (shared / "cluster-secret").chmod(0o600)
    database = pgserver.shared_server().fresh_database()
    env = dict(extra_env or {})
    if s3 is not None:
        env.update(s3.env(f"cluster-{secrets.token_hex(4)}"))
    workers = [
        Worker(
            root / f"state-{h}",
            h,
            shared,
            database,
            labels=(labels or {}).get(h, ""),
            extra_env=env,
            tunnel_port=_free_udp_port() if tunnel else 0,
        )
        for h in host_ids
    ]
    key = "hk_" + secrets.token_urlsafe(32)
    token_secret = secrets.token_bytes(32)
    for w in workers:
        w.state_dir.mkdir(parents=True)
        (w.state_dir / "api-key").write_text(key + "\n")
        (w.state_dir / "api-key").chmod(0o600)
        if e2b:
            # The E2B access tokens: one secret for the cluster, as the admin key.
            (w.state_dir / "e2b-token-secret").write_bytes(token_secret)
            (w.state_dir / "e2b-token-secret").chmod(0o600)
            w.daemon_env["HUTCH_E2B_LISTEN"] = f"127.0.0.1:{free_port()}"
        _LIVE.append(w)
    try:
        # The first start migrates the shared database; then the secrets key is shared.
        workers[0].start()
        for w in workers[1:]:
            shutil.copy(workers[0].state_dir / "secrets.key", w.state_dir / "secrets.key")
            w.start()
        yield workers
    finally:
        problems: list[str] = []
        for w in workers:
            problems += finalize_daemon(w)
        assert not problems, "\n".join(problems)


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def owners(workers: Sequence[Worker]) -> dict[str, str]:
    """Sandbox id -> the worker whose QEMU runs it (the processes on this machine)."""
    found: dict[str, str] = {}
    for w in workers:
        for sandbox_id in w.sandbox_qemus():
            assert sandbox_id not in found, f"{sandbox_id} runs on two workers"
            found[sandbox_id] = w.host_id
    return found


def create_on(w: Worker, **options: object) -> SandboxInfo:
    """A sandbox of ``MEMORY_MIB`` created through ``w`` (placement may put it anywhere)."""
    with w.client(timeout=300.0) as c:
        return c.create_sandbox(memory_mib=MEMORY_MIB, **options)  # type: ignore[arg-type]
