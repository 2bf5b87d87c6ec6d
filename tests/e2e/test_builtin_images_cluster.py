"""Two workers on separate machines whose ``base`` of one digest holds other bytes
(issue 14): a sandbox paused (memory) on worker 1 resumes on worker 2 with its
processes and its Python variable once worker 2 has converged on the bucket's bytes,
and is refused while it has not: placement reads the bytes each worker published and
answers 429 naming them, before anything is fetched, the sandbox staying paused.

Separate machines on one: each worker runs in a mount namespace of its own where its
own images directory is mounted at one path (``HUTCH_IMAGES_DIR`` is the same on both,
as on machines set up alike), so a frozen state's base path means the same file name
on both and other bytes. Worker 1's directory is a copy of the test images' ``base``;
worker 2's is a copy whose rootfs got one more file (``debugfs``): the same image, name
and digest, other bytes, as two hosts' builds are. PostgreSQL (``tests/pgserver.py``)
and SeaweedFS (``tests/s3server.py``) are shared. VM cost: one 128 MiB sandbox, cold
booted once (no templates, no pool), paused twice and resumed once elsewhere.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hutch import errors
from hutch.images import identity
from hutch.images.build import ImageArtifacts
from hutch.store import Store
from hutch.store.hosts import HostStore
from tests import pgserver
from tests.e2e.cluster.guest_state import counter, kept_state, with_state
from tests.e2e.cluster_lab import LEASE_S, Worker, owners
from tests.e2e.conftest import _LIVE, finalize_daemon, wait_for
from tests.s3server import S3Server, running_s3

pytestmark = [pytest.mark.e2e, pytest.mark.vm, pytest.mark.timeout(1500)]

#: The file worker 2's rootfs has and worker 1's has not: other bytes, one image.
MARKER = "hutch-worker-b"


class IsolatedWorker(Worker):
    """A worker whose images directory is its own, mounted at ``at`` in a mount
    namespace of its own (its QEMUs inherit it): another machine's images."""

    def __init__(self, images: Path, at: Path, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.own_images = images
        self.at = at

    def _spawn(self, args: list[str], start: int) -> subprocess.Popen[bytes]:
        script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
        with (self.state_dir / "logs" / f"stderr.{start}.log").open("wb") as err:
            return subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                 str(self.own_images), str(self.at), sys.executable, *args],
                env=self.daemon_env, cwd=self.state_dir.parent, stdin=subprocess.DEVNULL,
                stdout=err, stderr=err,
            )  # fmt: skip


@dataclass
class Lab:
    w1: IsolatedWorker
    w2: IsolatedWorker
    s3: S3Server
    database: str
    digest: str

    def rootfs(self, w: IsolatedWorker) -> Path:
        return w.own_images / "base" / self.digest / "rootfs.ext4"


def _copy_base(base: ImageArtifacts, images: Path) -> Path:
    """``base``'s directory copied (sparse) into ``images``, ``current`` naming it."""
    d = images / "base" / base.digest
    d.parent.mkdir(parents=True)
    subprocess.run(["cp", "-a", "--sparse=always", str(base.rootfs.parent), str(d)], check=True)
    (images / "base" / "current").write_text(base.digest + "\n")
    return d


def _other_bytes(d: Path, tmp: Path) -> None:
    """One more file in the rootfs (``/etc/MARKER``), its identity recorded anew in the
    manifest and beside it, as another host's build of the same image would have."""
    rootfs = d / "rootfs.ext4"
    (tmp / "marker").write_text("built on worker 2\n")
    (tmp / "debugfs.cmd").write_text(f"cd /etc\nwrite {tmp / 'marker'} {MARKER}\n")
    rootfs.chmod(0o644)
    done = subprocess.run(
        ["debugfs", "-w", "-f", str(tmp / "debugfs.cmd"), str(rootfs)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rootfs.chmod(0o444)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["rootfs_sha256"] = identity.record(rootfs)
    (d / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


@pytest.fixture(scope="module")
def lab(base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    root = tmp_path_factory.mktemp("builtin")
    at = root / "images"  # the one path both "machines" see their images at
    at.mkdir()
    _copy_base(base_image, root / "w1-images")
    _other_bytes(_copy_base(base_image, root / "w2-images"), root)
    shared = root / "shared"
    shared.mkdir()
    (shared / "cluster-secret").write_text(secrets.token_hex(32) + "\n")
    database = pgserver.shared_server().fresh_database()
    with running_s3(tmp_path_factory) as s3:
        env = {
            **s3.env(f"builtin-{secrets.token_hex(4)}"),
            "HUTCH_IMAGES_DIR": str(at),
            "HUTCH_TEMPLATES": "0",  # one cold boot, no template build beside it
            "HUTCH_POOL_SIZE": "0",
        }
        w1, w2 = (
            IsolatedWorker(
                root / f"{h}-images", at, root / f"state-{h}", h, shared, database, extra_env=env
            )
            for h in ("w1", "w2")
        )
        key = "hk_" + secrets.token_urlsafe(32)
        for w in (w1, w2):
            w.state_dir.mkdir(parents=True)
            (w.state_dir / "api-key").write_text(key + "\n")
            (w.state_dir / "api-key").chmod(0o600)
            _LIVE.append(w)
        try:
            yield Lab(w1, w2, s3, database, base_image.digest)
        finally:
            problems: list[str] = []
            for w in (w1, w2):
                problems += finalize_daemon(w)
            assert not problems, "\n".join(problems)


@contextlib.contextmanager
def _a_create_holds(d: Path) -> Iterator[None]:
    """What a create on that worker holds while it runs: the directory's ``.use`` lock,
    shared (an adoption takes it exclusively and so waits)."""
    fd = os.open(d.parent / f"{d.name}.use", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def test_a_pause_resumes_on_a_worker_whose_base_held_other_bytes_once_it_converged(
    lab: Lab,
) -> None:
    w1, w2, s3 = lab.w1, lab.w2, lab.s3
    w1_sha = identity.known(lab.rootfs(w1))
    w2_sha = identity.known(lab.rootfs(w2))
    assert w1_sha is not None and w2_sha is not None and w1_sha != w2_sha

    w1.start()
    # w1 uploads its built-in images in the background (the first upload wins).
    index = f"images/builtin/base/{lab.digest}/index.json"
    assert wait_for(lambda: index in w1.blob_keys(s3, "images/builtin/base/"), 300)
    shutil.copy(w1.state_dir / "secrets.key", w2.state_dir / "secrets.key")
    # One client through w1 for the whole test (any worker's API reaches the VM; the
    # handle keeps the context that holds the Python variable).
    with w1.client(timeout=300.0) as c:
        with _a_create_holds(lab.rootfs(w2).parent):
            w2.start()
            # Its start finds its copy unlike the upload and keeps it while it is held.
            assert wait_for(lambda: "kept while a create" in w2.log_path.read_text(), 300)
            assert identity.compute(lab.rootfs(w2)) == w2_sha
            sb, before = with_state(c, placement={"host": "w1"})
            assert owners([w1, w2])[sb.id] == "w1"
            at = c.pause_sandbox(sb.id).paused_at
            assert wait_for(lambda: w1.pause_uploaded(s3, sb.id, at), 120)
            # Not converged: refused by placement (w2 published other bytes of base),
            # and nothing changed (it stays paused on w1).
            with pytest.raises(
                errors.Capacity, match=r"w2 cannot restore the pause of .*holds other bytes"
            ):
                c.resume_sandbox(sb.id, {"host": "w2"})
            assert c.get_sandbox(sb.id).state == "paused"
            assert sb.id not in w2.sandbox_dirs()

        # Nothing holds it now: w2's next start replaces its copy before anything else.
        w2.stop()
        w2.start()
        assert wait_for(lambda: identity.known(lab.rootfs(w2)) == w1_sha, 300)
        assert identity.compute(lab.rootfs(w2)) == w1_sha  # the bytes w1 uploaded
        published = HostStore(Store(lab.database)).get("w2")
        assert published is not None and published.images == {"base": {lab.digest: w1_sha}}

        assert c.resume_sandbox(sb.id, {"host": "w2"}).state == "running"
        assert owners([w1, w2])[sb.id] == "w2"
        kept_state(c, sb, before)
        assert counter(c, sb.id) > before
        # w1 drops the files and tap of the sandbox that left (at a lease renewal).
        assert wait_for(lambda: sb.id not in w1.sandbox_dirs(), LEASE_S * 4)
        c.delete_sandbox(sb.id)
