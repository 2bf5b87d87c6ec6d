"""``cross_host``: resume of a memory-paused sandbox on another host (its pause fetched
from S3 and verified) against resume on the host that paused it (nothing fetched), in
one run.

Two side daemons form a cluster on this machine (workers ``a`` and ``b``: one shared
WAL SQLite file, one cluster secret, one SeaweedFS bucket from ``tests/s3server.py`` as
the blob store). A 256 MiB sandbox with 64 MiB (16 MiB quick) of guest memory dirtied
runs on one of them. Each round, on the host it is on now:

* same host: pause (memory), wait until the pause's upload is complete, then
  ``resume`` + ``exec(["true"])`` through that host (the local files are used);
* cross host: pause, wait for the upload, drain the host (nothing else runs there),
  then ``resume`` + ``exec(["true"])`` through the other host, which fetches the pause
  (state, disk, the layers under it), checks every blob's sha256 and the stream's
  digest, and restores it; undrain. The sandbox now lives on the other host.

The upload happens before both timings (pauses are uploaded in the background), so the
ratio is what a move adds to a resume: the download, the checks and the re-pointing.
"""

from __future__ import annotations

import secrets
import shutil
import time

from tests.s3server import BUCKET, S3Server

from bench.cases.common import SANDBOX_VCPUS, BenchContext, now
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox
from hutch.sdk import Client

__all__ = ["run_cross_host"]

MEMORY_MIB = 256
BLOB_PREFIX = "bench-xhost"


def _uploaded(server: S3Server, sandbox_id: str) -> bool:
    listed = server.client().list_objects_v2(
        Bucket=BUCKET, Prefix=f"{BLOB_PREFIX}/pauses/{sandbox_id}/"
    )
    return any(o["Key"].endswith("/index.json") for o in listed.get("Contents", []))


def _wait_uploaded(server: S3Server, sandbox_id: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _uploaded(server, sandbox_id):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pause of {sandbox_id} was not uploaded in {timeout_s:.0f} s")
        time.sleep(0.2)


def _timed_resume(c: Client, sandbox_id: str) -> float:
    t0 = now()
    c.resume_sandbox(sandbox_id)
    if c.exec(sandbox_id, ["true"]).exit_code != 0:
        raise RuntimeError(f"{sandbox_id}: no answer after its resume")
    return now() - t0


def run_cross_host(ctx: BenchContext) -> BenchResult:
    rounds = 2 if ctx.quick else 4
    dirty_mib = 16 if ctx.quick else 64
    result = BenchResult(
        "cross_host",
        "resume on another host (fetched from S3) vs on the same host",
        ctx.quick,
        {"rounds": rounds, "dirty_mib": dirty_mib, "memory_mib": MEMORY_MIB, "image": ctx.image},
    )
    root = ctx.work_dir / "xhost"
    root.mkdir(parents=True, exist_ok=True)
    secret = root / "cluster-secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    server = S3Server(root / "s3")
    server.start()
    same: list[float] = []
    cross: list[float] = []
    try:
        common = {
            **server.env(BLOB_PREFIX),
            "HUTCH_ROLE": "worker",
            "HUTCH_SHARED_DB": str(root / "cluster.db"),
            "HUTCH_CLUSTER_SECRET_FILE": str(secret),
            # One images directory for both: no built-in image to converge (uploading
            # ~3 GB of them would run beside what is measured).
            "HUTCH_BLOB_BUILTIN_IMAGES": "0",
        }
        workers = {
            h: ctx.side_daemon(f"xhost-{h}", {**common, "HUTCH_HOST_ID": h}) for h in ("a", "b")
        }
        clients = {h: w.daemon.client(timeout=600.0) for h, w in workers.items()}
        info = clients["a"].create_sandbox(
            image=ctx.image,
            vcpus=SANDBOX_VCPUS,
            memory_mib=MEMORY_MIB,
            placement={"host": "a"},
        )
        sb = Sandbox(clients["a"], info)
        sb.exec(["sh", "-c", f"head -c {dirty_mib}M /dev/urandom > /dev/shm/dirty"])
        digest = sb.exec(["sha256sum", "/dev/shm/dirty"]).stdout
        here, there = "a", "b"
        try:
            for i in range(rounds):
                c = clients[here]
                c.pause_sandbox(info.id)
                _wait_uploaded(server, info.id)
                same.append(_timed_resume(c, info.id))
                c.pause_sandbox(info.id)
                _wait_uploaded(server, info.id)
                c.hosts.drain(here)
                try:
                    cross.append(_timed_resume(clients[there], info.id))
                finally:
                    c.hosts.undrain(here)
                if clients[there].exec(info.id, ["sha256sum", "/dev/shm/dirty"]).stdout != digest:
                    raise RuntimeError(f"{info.id}: its memory changed in the move")
                ctx.log(
                    f"  round {i + 1}/{rounds}: same-host resume+exec {same[-1]:.3f} s, "
                    f"{here}->{there} {cross[-1]:.3f} s"
                )
                here, there = there, here
        finally:
            clients[here].delete_sandbox(info.id)
            for c in clients.values():
                c.close()
    finally:
        for h in ("a", "b"):
            ctx.stop_side_daemon(f"xhost-{h}")
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    result.metrics = [
        Metric(
            "cross_host_resume",
            "s",
            "lower",
            "resume + exec(true) through another host (pause fetched from S3, verified) "
            "÷ the same on the host that paused it (its local files)",
            SampleSet("resume on another host + exec(['true'])", cross),
            SampleSet("resume on the same host + exec(['true'])", same),
        )
    ]
    result.notes.append(
        "both hosts and the S3 server run on this machine (loopback, one disk): the "
        "difference is the download, the checks and the re-pointing, not a network"
    )
    return result
