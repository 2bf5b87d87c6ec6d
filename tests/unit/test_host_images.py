"""What each host publishes of its built-in images (``hosts.images_json``, migration
18), on both backends: written by the host on its own, read back with the row, and
kept by a registration (a host re-registering after a missed lease keeps what it
published)."""

from __future__ import annotations

from pathlib import Path

from hutch.store import Store
from hutch.store.hosts import HostRow, HostStore

D1, D2 = "0123456789abcdef", "fedcba9876543210"


def _row(host_id: str) -> HostRow:
    return HostRow(host_id, "127.0.0.1:1", "worker", "up", 2, 1024, 10, 10, "tcg", "8", "x")


def test_published_images_are_read_back_and_outlive_a_registration(
    db_target: Path | str,
) -> None:
    hosts = HostStore(Store(db_target))
    assert not hosts.set_images("w1", {"base": {D1: "a" * 64}})  # not registered yet
    hosts.register(_row("w1"))
    hosts.register(_row("w2"))
    found = hosts.get("w1")
    assert found is not None and found.images == {}  # nothing published yet
    held = {"base": {D2: "b" * 64, D1: "a" * 64}, "devbox": {D1: "c" * 64}}
    assert hosts.set_images("w1", held)
    hosts.register(_row("w1"))  # a restart, or a re-registration after a missed lease
    assert {h.id: h.images for h in hosts.all()} == {"w1": held, "w2": {}}
    reopened = HostStore(Store(db_target)).get("w1")
    assert reopened is not None and reopened.images == held
