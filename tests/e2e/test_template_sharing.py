"""A template made on one host serves another (``services/template_blobs.py``): two
hutchd workers share one PostgreSQL database, one SeaweedFS bucket and the images
directory. Worker t1's first create of base at a shape boots cold and builds the
template in the background, which is uploaded; worker t2's first create of that image
and shape fetches it from the bucket instead of booting (its log and the create's
origin say so, and t2 never built one), answers exec, and two clones on t2 map the
fetched ``memory.ram`` privately while its sealed digest stays what t1 sealed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hutch.images.build import ImageArtifacts
from hutch.sdk import Client
from hutch.vm.snapshot_dir import load_manifest
from hutch.vm.snapshot_manifest import MEMORY_FILE, fd_digest
from tests.e2e.cluster_lab import MEMORY_MIB, Worker, cluster_of, owners
from tests.e2e.conftest import wait_for
from tests.s3server import S3Server, s3_server

__all__ = ["s3_server"]

pytestmark = [pytest.mark.e2e, pytest.mark.vm, pytest.mark.timeout(900)]


def _origin(c: Client, sandbox_id: str) -> str:
    events = c.sandbox_events(sandbox_id, types="sandbox.created").events
    assert len(events) == 1, events
    return str(events[0].data["from"])


def _template_dirs(w: Worker) -> list[Path]:
    root = w.state_dir / "templates"
    return [d for d in root.iterdir() if (d / "vm.json").is_file()] if root.is_dir() else []


def _maps_privately(w: Worker, sandbox_id: str, memory_file: Path) -> bool:
    """The sandbox's QEMU maps ``memory_file``, and only privately (copy-on-write)."""
    maps = Path(f"/proc/{w.qemu_pid_of(sandbox_id)}/maps").read_text().splitlines()
    mapped = [m.split()[1] for m in maps if m.endswith(str(memory_file))]
    return bool(mapped) and all(perms[3] == "p" for perms in mapped)


def test_the_second_host_fetches_the_template_instead_of_booting(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
) -> None:
    root = tmp_path_factory.mktemp("tplshare")
    with cluster_of(root, ("t1", "t2"), s3=s3_server) as (t1, t2):
        with t1.client(timeout=600.0) as c:
            cold = c.create_sandbox(memory_mib=MEMORY_MIB, placement={"host": "t1"})
            assert _origin(c, cold.id) == "cold"
        # t1 builds the template in the background and uploads it.
        assert wait_for(
            lambda: any(k.endswith("/index.json") for k in t1.blob_keys(s3_server, "templates/")),
            600,
        ), t1.log_path.read_text()[-3000:]
        (made,) = _template_dirs(t1)
        keys = t1.blob_keys(s3_server, "templates/")
        assert f"templates/base/{base_image.digest}/" in keys[0]
        assert not any(k.endswith("/" + MEMORY_FILE) for k in keys)  # its non-zero pages only
        assert _template_dirs(t2) == []

        with t2.client(timeout=600.0) as c:
            first = c.create_sandbox(memory_mib=MEMORY_MIB, placement={"host": "t2"})
            second = c.create_sandbox(memory_mib=MEMORY_MIB, placement={"host": "t2"})
            assert owners([t1, t2])[first.id] == owners([t1, t2])[second.id] == "t2"
            assert _origin(c, first.id) == _origin(c, second.id) == "template"
            assert c.exec(first.id, ["echo", "ok"]).stdout == "ok\n"
            assert c.exec(second.id, ["hostname"]).stdout.strip() == second.id
            log = t2.log_path.read_text()
            assert f"template of base at 1c-{MEMORY_MIB}m-" in log and "fetched from s3://" in log
            assert "uploaded by host t1" in log
            assert "template ready for base" not in log  # t2 built none (no cold boot)
            (fetched,) = _template_dirs(t2)
            assert fetched.name == made.name
            kept = json.loads((fetched / "template.json").read_text())
            assert kept == json.loads((made / "template.json").read_text())
            # Both clones map the fetched memory.ram copy-on-write; it stays as sealed.
            for sb in (first, second):
                assert _maps_privately(t2, sb.id, fetched / MEMORY_FILE)
            c.exec(first.id, ["sh", "-c", "head -c 16M /dev/urandom > /dev/shm/x"])
            sealed = load_manifest(fetched).memory
            assert sealed is not None and sealed.digest is not None
            made_sealed = load_manifest(made).memory
            assert made_sealed is not None and sealed.digest == made_sealed.digest
            fd = os.open(fetched / MEMORY_FILE, os.O_RDONLY)
            try:
                assert fd_digest(fd, sealed.digest.partition(":")[0])[0] == sealed.digest
            finally:
                os.close(fd)
            for sb in (first, second):
                c.delete_sandbox(sb.id)
        with t1.client() as c:
            c.delete_sandbox(cold.id)
