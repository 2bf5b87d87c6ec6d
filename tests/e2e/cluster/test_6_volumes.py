"""Volumes in the cluster: a volume's file is on the worker that made it, sandboxes that
mount it run there whichever worker is asked, and the volume's calls reach its file
through any worker (real guests, the data on a real ext4 file)."""

from __future__ import annotations

import pytest

from hutch import errors
from tests.e2e.cluster_lab import MEMORY_MIB, Worker, create_on, owners
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

MIB = 1 << 20


def test_a_volume_stays_on_its_worker_and_its_sandboxes_run_there(cluster: list[Worker]) -> None:
    w1, w2, w3 = cluster
    with w2.client() as c:
        vol = c.volumes.create("notes", 64 * MIB)
    assert vol.host == "w2"
    volume_file = w2.state_dir / "volumes" / f"{vol.id}.img"
    assert volume_file.is_file()
    # Made through w1, it runs on w2, where the volume's file is; the data goes there.
    first = create_on(w1, volumes=["notes:/data"])
    assert owners(cluster)[first.id] == "w2"
    with w3.client() as c:
        c.exec(first.id, ["sh", "-c", "echo kept across sandboxes > /data/note; sync"])
        seen = c.volumes.get("notes")
        assert (seen.host, [u.sandbox_id for u in seen.mounted_by]) == ("w2", [first.id])
        assert seen.used is not None and seen.used > 0  # read where the file is
        # Exclusive: a second sandbox is refused wherever it is asked, nothing made.
        with pytest.raises(errors.Conflict, match="is mounted by sandbox"):
            c.create_sandbox(memory_mib=MEMORY_MIB, volumes=["notes:/data"])
        c.delete_sandbox(first.id)
    assert wait_for(lambda: first.id not in owners(cluster), 20)
    # The next sandbox, asked through w3 with w1 pinned, is refused naming the volume's
    # host; without the pin it lands on w2 and reads what the first one wrote.
    with w3.client() as c, pytest.raises(errors.InvalidArgument, match="are on host w2"):
        c.create_sandbox(
            memory_mib=MEMORY_MIB, volumes=["notes:/data:ro"], placement={"host": "w1"}
        )
    second = create_on(w3, volumes=["notes:/data:ro"])
    assert owners(cluster)[second.id] == "w2"
    with w1.client() as c:
        assert c.exec(second.id, ["cat", "/data/note"]).stdout == "kept across sandboxes\n"
        c.delete_sandbox(second.id)
        # Grown and deleted through w1: w2's file.
        assert c.volumes.grow("notes", 96 * MIB).size == 96 * MIB
        assert volume_file.stat().st_size == 96 * MIB
        c.volumes.delete("notes")
    assert not volume_file.exists()
