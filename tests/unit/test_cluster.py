"""The pieces of the cluster that need no daemon: placement, the signed host-to-host
principal, the hosts table on a real SQLite file shared by two stores (two hutchds),
and the cluster settings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hutch.config import load_settings
from hutch.contract.auth import Principal, Role
from hutch.contract.placement import Placement, parse_placement
from hutch.errors import Capacity, Conflict, InvalidArgument, Unauthorized
from hutch.services.cluster_auth import ClusterSigner
from hutch.services.placement import Frozen, choose_host, keep_labels, require_labels
from hutch.store import Store
from hutch.store.hosts import HostRow, HostStore, HostUse

NOW = 1_000_000.0


def _host(host_id: str, memory: int = 4096, **kw: object) -> HostRow:
    fields: dict[str, object] = {
        "address": f"http://127.0.0.1:{7000 + int(host_id[-1])}",
        "role": "worker", "state": "up", "vcpus": 2, "memory_mib": memory, "disk_gib": 10,
        "max_sandboxes": 64, "accel": "tcg", "qemu_version": "7.2.0", "cpu_model": "cpu",
        "labels": {}, "started_at": NOW, "renewed_at": NOW, "lease_until": NOW + 10,
    }  # fmt: skip
    fields.update(kw)
    return HostRow(id=host_id, **fields)  # type: ignore[arg-type]


# -- placement -------------------------------------------------------------------------------


def test_spread_takes_the_most_free_memory_and_pack_the_least() -> None:
    hosts = [_host("w1"), _host("w2"), _host("w3")]
    use = {"w1": HostUse(2, 2, 2, 1024), "w2": HostUse(1, 1, 1, 512), "w3": HostUse(3, 3, 3, 3000)}
    assert choose_host(hosts, use, Placement(), memory_mib=512, now=NOW).id == "w2"
    packed = choose_host(hosts, use, Placement(strategy="pack"), memory_mib=512, now=NOW)
    assert packed.id == "w3"  # 1096 MiB free, the least that still fits
    # 2000 MiB fits w1 and w2 only: pack takes w1.
    assert choose_host(hosts, use, Placement(strategy="pack"), memory_mib=2000, now=NOW).id == "w1"


def test_spread_over_equal_hosts_goes_round_by_count_then_id() -> None:
    hosts = [_host("w1"), _host("w2"), _host("w3")]
    use: dict[str, HostUse] = {}
    order = []
    for _ in range(6):
        chosen = choose_host(hosts, use, Placement(), memory_mib=128, now=NOW)
        order.append(chosen.id)
        held = use.get(chosen.id, HostUse())
        use[chosen.id] = HostUse(held.sandboxes + 1, held.running + 1, 1, held.memory_mib + 128)
    assert order == ["w1", "w2", "w3", "w1", "w2", "w3"]


def test_down_draining_expired_and_full_hosts_are_skipped_with_reasons() -> None:
    hosts = [
        _host("w1", state="down"),
        _host("w2", state="draining"),
        _host("w3", lease_until=NOW - 1),
        _host("w4", max_sandboxes=1),
        _host("w5", memory=256),
    ]
    use = {"w4": HostUse(1, 1, 1, 128)}
    with pytest.raises(Capacity) as caught:
        choose_host(hosts, use, Placement(), memory_mib=512, now=NOW)
    message = str(caught.value)
    for fragment in (
        "w1 is down",
        "w2 is draining",
        "w3 is not renewing its lease",
        "w4 holds 1/1 sandboxes",
        "w5 has 256 MiB free, 512 MiB asked",
    ):
        assert fragment in message


def test_pinning_by_host_and_labels_and_bad_selectors() -> None:
    hosts = [_host("w1", labels={"zone": "a"}), _host("w2", labels={"zone": "b", "gpu": "no"})]
    assert choose_host(hosts, {}, Placement(host="w2"), memory_mib=128, now=NOW).id == "w2"
    by_label = Placement(labels={"zone": "b"})
    assert choose_host(hosts, {}, by_label, memory_mib=128, now=NOW).id == "w2"
    with pytest.raises(InvalidArgument, match=r"'w9' is not a host of this cluster; hosts: w1, w2"):
        choose_host(hosts, {}, Placement(host="w9"), memory_mib=128, now=NOW)
    with pytest.raises(
        InvalidArgument, match=r"no host has the labels zone=c; .*w2: gpu=no, zone=b"
    ):
        choose_host(hosts, {}, Placement(labels={"zone": "c"}), memory_mib=128, now=NOW)
    with pytest.raises(Capacity, match="w1 is down"):
        choose_host([_host("w1", state="down")], {}, Placement(host="w1"), memory_mib=1, now=NOW)


def test_a_create_from_a_snapshot_goes_to_its_host_with_the_same_qemu() -> None:
    hosts = [_host("w1"), _host("w2")]
    frozen = Frozen("w2")
    chosen = choose_host(hosts, {}, Placement(), memory_mib=128, now=NOW, frozen=frozen)
    assert chosen.id == "w2"
    with pytest.raises(Capacity, match="w1 does not hold the snapshot's files"):
        choose_host(hosts, {}, Placement(host="w1"), memory_mib=128, now=NOW, frozen=frozen)


def test_an_uploaded_snapshot_may_land_on_any_host_with_its_qemu_and_cpu() -> None:
    hosts = [_host("w1"), _host("w2", 2048), _host("w3", qemu_version="8.0.0")]
    use = {"w1": HostUse(sandboxes=1, running=1, vcpus=1, memory_mib=1024)}
    # Uploaded: w1 (most free memory, same QEMU and CPU) though w2 saved it.
    frozen = Frozen("w2", anywhere=True)
    chosen = choose_host(hosts, use, Placement(), memory_mib=128, now=NOW, frozen=frozen)
    assert chosen.id == "w1"
    with pytest.raises(
        Capacity, match=r"w3 cannot restore the snapshot: it runs QEMU 8\.0\.0, w2 .* 7\.2\.0"
    ):
        choose_host(hosts, use, Placement(host="w3"), memory_mib=128, now=NOW, frozen=frozen)


def test_a_pause_moves_only_to_a_host_that_can_restore_it() -> None:
    """A resume elsewhere or a move off a draining or down host restores the pause's
    memory: only on the QEMU build and CPU model of the host that paused it."""
    hosts = [
        _host("w1"),
        _host("w2", 8192, qemu_version="8.2.0"),
        _host("w3", 8192, cpu_model="other cpu"),
        _host("w4"),
    ]
    pause = Frozen("w1", anywhere=True, what="the pause of sb-1")
    # w2 and w3 have the most room but cannot restore it; w4 can.
    assert (
        choose_host(hosts, {}, Placement(), memory_mib=128, now=NOW, frozen=pause, exclude="w1").id
        == "w4"
    )
    # Nowhere else: each refusal says why.
    with pytest.raises(Capacity) as refused:
        choose_host(hosts[:3], {}, Placement(), memory_mib=128, now=NOW, frozen=pause, exclude="w1")
    assert refused.value.message == (
        "no host has room for this sandbox: w1 is the host it moves off; "
        "w2 cannot restore the pause of sb-1: it runs QEMU 8.2.0, w1 (which froze it) 7.2.0; "
        "w3 cannot restore the pause of sb-1: its CPU is 'other cpu', w1's is 'cpu'"
    )


def test_a_pause_of_a_built_in_image_moves_only_where_its_bytes_are() -> None:
    """Each host publishes its built-in images' rootfs sha256; a pause frozen over one
    copy goes to a host holding the same bytes, or lacking that digest when the blob
    store's upload of it is those bytes (it fetches them), never elsewhere."""
    mine, other = "a" * 64, "b" * 64
    hosts = [
        _host("w1", images={"base": {"d1": mine}}),
        _host("w2", 8192, images={"base": {"d1": other}}),  # most room, other bytes
        _host("w3", 4096, images={"base": {"d0": other}}),  # lacks d1
    ]

    def place(uploaded: str | None, only: str | None = None) -> HostRow:
        pause = Frozen("w1", True, "the pause of sb-1", "base", "d1", mine, uploaded)
        return choose_host(
            hosts, {}, Placement(host=only), memory_mib=128, now=NOW, frozen=pause, exclude="w1"
        )

    assert place(uploaded=mine).id == "w3"  # fetches the uploaded copy, the same bytes
    with pytest.raises(Capacity) as refused:
        place(uploaded=other)
    assert (
        "w2 cannot restore the pause of sb-1: its image base (d1) holds other bytes"
        in refused.value.message
    )
    assert "w3 cannot restore the pause of sb-1" in refused.value.message
    # Nothing to compare (an imported image, no identity published): not filtered.
    unknown = Frozen("w1", True, "the pause", "base", "d1", None, None)
    chosen = choose_host(hosts, {}, Placement(), memory_mib=128, now=NOW, frozen=unknown)
    assert chosen.id == "w2"


def test_a_move_never_lands_on_the_host_it_leaves() -> None:
    hosts = [_host("w1", 8192), _host("w2")]
    assert choose_host(hosts, {}, Placement(), memory_mib=128, now=NOW, exclude="w1").id == "w2"
    with pytest.raises(Capacity, match="w1 is the host it moves off"):
        choose_host(hosts, {}, Placement(host="w1"), memory_mib=128, now=NOW, exclude="w1")


def test_a_move_keeps_the_labels_the_sandbox_was_created_with() -> None:
    hosts = [
        _host("w1", labels={"zone": "a"}),
        _host("w2", labels={"zone": "a"}),
        _host("w3", 8192, labels={"zone": "b"}),
    ]

    def move(labels: dict[str, str], hosts: list[HostRow] = hosts) -> HostRow:
        return keep_labels(
            "sb-1",
            labels,
            "the move",
            lambda: choose_host(
                hosts, {}, Placement(labels=labels), memory_mib=128, now=NOW, exclude="w1"
            ),
        )

    # w3 has the most room, but a zone=a sandbox leaving w1 goes to w2.
    assert move({}).id == "w3"
    assert move({"zone": "a"}).id == "w2"
    # zone=b is w3 alone: while it drains, nowhere (retry later), named.
    draining = [*hosts[:2], _host("w3", labels={"zone": "b"}, state="draining")]
    with pytest.raises(Capacity, match=r"placement\.labels zone=b, .*w3 is draining"):
        move({"zone": "b"}, draining)
    # Labels no host carries any more: a conflict naming them, never another host.
    with pytest.raises(Conflict, match=r"sb-1: it was created with placement\.labels zone=c"):
        move({"zone": "c"})


def test_a_host_without_the_sandboxs_labels_refuses_to_take_it() -> None:
    require_labels("sb-1", {"zone": "a"}, "w1", {"zone": "a", "gpu": "no"}, "the move")
    require_labels("sb-1", {}, "w1", {}, "the fork")
    with pytest.raises(Conflict, match=r"host w3: .* zone=a and this host lacks zone=a \(its "):
        require_labels("sb-1", {"zone": "a"}, "w3", {"zone": "b"}, "the fork")


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ("w1", "placement must be an object"),
        ({"hots": "w1"}, "unknown key(s) ['hots']; accepted: host, labels, strategy"),
        ({"host": "a b"}, "placement.host 'a b' is not a host id"),
        ({"labels": {"zone": ""}}, "placement.labels 'zone': '' is not a label"),
        ({"labels": ["zone"]}, "placement.labels must be an object"),
        ({"strategy": "random"}, "placement.strategy 'random'; accepted: spread, pack"),
    ],
)
def test_bad_placement_documents_say_what_is_accepted(doc: object, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_placement(doc)
    assert fragment in str(caught.value)


# -- the signed principal ----------------------------------------------------------------------


def test_a_forward_carries_the_callers_principal_for_one_method_and_path() -> None:
    a, b = ClusterSigner(b"s" * 64, "w1"), ClusterSigner(b"s" * 64, "w2")
    who = Principal("key-1", "team", Role.DEVELOPER, "10.0.0.9")
    headers = a.sign(who, "POST", "/v1/sandboxes/sb-0123456789ab/exec")
    assert "authorization" not in {k.lower() for k in headers}
    assert b.verify(headers, "POST", "/v1/sandboxes/sb-0123456789ab/exec") == who
    with pytest.raises(Unauthorized, match="wrong signature"):
        b.verify(headers, "DELETE", "/v1/sandboxes/sb-0123456789ab")
    with pytest.raises(Unauthorized, match="wrong signature"):
        ClusterSigner(b"t" * 64, "w3").verify(headers, "POST", "/v1/sandboxes/sb-0123456789ab/exec")
    forged = {**headers, "hutch-cluster-principal": a.sign(Principal.admin(), "POST", "/x")[
        "hutch-cluster-principal"
    ]}  # fmt: skip
    with pytest.raises(Unauthorized, match="wrong signature"):
        b.verify(forged, "POST", "/v1/sandboxes/sb-0123456789ab/exec")


def test_an_old_forward_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    signer = ClusterSigner(b"s" * 64, "w1")
    headers = signer.sign(Principal.admin(), "GET", "/v1/hosts")
    later = time.time() + 120
    monkeypatch.setattr(time, "time", lambda: later)
    with pytest.raises(Unauthorized, match="signed 120 s away"):
        signer.verify(headers, "GET", "/v1/hosts")


# -- the hosts table, two hutchds on one SQLite file ---------------------------------------------


def test_two_stores_on_one_file_mark_an_expired_host_down_once(tmp_path: Path) -> None:
    one, two = Store(tmp_path / "shared.db"), Store(tmp_path / "shared.db")
    try:
        h1, h2 = HostStore(one), HostStore(two)
        h1.register(_host("w1", lease_until=NOW + 5))
        h2.register(_host("w2", lease_until=NOW + 30))
        assert [h.id for h in h2.all()] == ["w1", "w2"]
        assert h1.expire(NOW + 1) == [] and h2.expire(NOW + 1) == []
        assert h2.expire(NOW + 6) == ["w1"]
        assert h1.expire(NOW + 6) == []  # already down: marked once
        down = h1.get("w1")
        assert down is not None and down.state == "down"
        assert "lease expired" in (down.down_reason or "")
        assert not h1.renew("w1", NOW + 7, NOW + 12)  # a stalled host learns it is fenced
        assert h1.unswept() == ["w1"]
        assert h2.claim_sweep("w1") and not h1.claim_sweep("w1")
        assert h1.unswept() == []
        h1.register(_host("w1", lease_until=NOW + 40))  # it comes back
        back = h2.get("w1")
        assert back is not None and back.state == "up" and back.down_reason is None
        assert h1.set_state("w1", "draining") and h2.get("w1").state == "draining"  # type: ignore[union-attr]
    finally:
        one.close()
        two.close()


# -- settings ------------------------------------------------------------------------------------


def test_cluster_settings_from_the_environment(tmp_path: Path) -> None:
    s = load_settings(
        {
            "HUTCH_STATE_DIR": str(tmp_path),
            "HUTCH_ROLE": "worker",
            "HUTCH_HOST_ID": "w1",
            "HUTCH_HOST_LABELS": "zone=a, gpu=no",
            "HUTCH_HOST_LEASE_S": "5",
            "HUTCH_SHARED_DB": str(tmp_path / "c.db"),
        }
    )
    assert s.host_id == "w1" and s.cluster.worker and s.cluster.lease_s == 5.0
    assert dict(s.cluster.labels) == {"zone": "a", "gpu": "no"}
    assert s.db_path == tmp_path / "c.db"
    assert load_settings({"HUTCH_STATE_DIR": str(tmp_path)}).host_id == "local"


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"HUTCH_ROLE": "boss"}, "HUTCH_ROLE='boss'; accepted: single, worker"),
        ({"HUTCH_HOST_LABELS": "zone"}, "HUTCH_HOST_LABELS: 'zone' is not key=value"),
        ({"HUTCH_HOST_LEASE_S": "1"}, "HUTCH_HOST_LEASE_S=1; accepted: 2-3600 s"),
        ({"HUTCH_HOST_ADDRESS": "127.0.0.1:7070"}, "use http://HOST:PORT"),
        ({"HUTCH_HOST_ID": "a/b"}, "HUTCH_HOST_ID='a/b'"),
    ],
)
def test_bad_cluster_settings_name_the_variable(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        load_settings(env)
    assert fragment in str(caught.value)
