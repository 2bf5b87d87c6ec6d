"""The nftables dataplane (the package's docstring says how it is proven). Here:
adding and removing sandboxes, counters, the table read back against its render, apply
timings, and the QEMU user's own packets.
"""

from __future__ import annotations

import dataclasses
import pwd
import time
from ipaddress import IPv4Address

import pytest

from hutch.net.addressing import AddressPool, tap_name
from hutch.net.nft import RulesetState, render_table
from hutch.net.nft_apply import apply, list_table, read_counters
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.nft_sandbox import render_add_sandbox, render_remove_sandbox, render_replace_policy
from hutch.net.rules import parse_policy
from tests.privileged.conftest import Guest, Lab
from tests.privileged.dataplane.tables import NET, blocked, install, reached, sandbox, tcp, udp

pytestmark = pytest.mark.privileged

#: Linux's initial retransmission timeout for a SYN (TCP_TIMEOUT_INIT).
SYN_RETRANSMIT_S = 1.0


# ------------------------------------------------------------------------- lifecycle


async def test_add_and_remove_sandbox(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a, b = guests["a"], guests["b"]
    await install(lab, cfg, [sandbox(a)])
    assert blocked(lab.tcp(b, "198.18.1.1", 80)), "b is not registered yet"

    await apply(render_add_sandbox(cfg, sandbox(b)), netns=lab.host)
    await apply(render_add_sandbox(cfg, sandbox(b)), netns=lab.host)  # idempotent
    assert reached(lab.tcp(b, "198.18.1.1", 80), "internet")

    await apply(render_remove_sandbox(cfg, sandbox(b)), netns=lab.host)
    await apply(render_remove_sandbox(cfg, sandbox(b)), netns=lab.host)  # idempotent
    assert blocked(lab.tcp(b, "198.18.1.1", 80))
    assert reached(lab.tcp(a, "198.18.1.1", 80), "internet")
    names = {
        item["chain"]["name"] for item in await list_table(cfg.tag, lab.host) if "chain" in item
    }
    assert f"sb_{a.sandbox_id[3:]}" in names and f"sb_{b.sandbox_id[3:]}" not in names


async def test_counters_move(lab: Lab, cfg: TableConfig, guests: dict[str, Guest]) -> None:
    a, b = guests["a"], guests["b"]
    await install(lab, cfg, [sandbox(a), sandbox(b, ["198.18.1.1"])])
    before = await read_counters(cfg.tag, netns=lab.host)
    assert before[a.sandbox_id].allowed == 0 and before[a.sandbox_id].denied == 0
    # The allow counter counts packets that meet the policy: every SYN of a connection
    # not yet answered, retransmissions too. Probes that give up before Linux's first SYN
    # retransmission (1 s) send one SYN each, so the allowed count is exact however slow
    # a loaded host is to answer (at load 10, a 1.5 s probe counted a retransmitted SYN).
    once = SYN_RETRANSMIT_S * 0.8
    probes_a = [tcp("198.18.1.1", 80), tcp("198.18.2.1", 80), tcp("198.18.1.1", 25)]
    lab.probe(a.netns, probes_a, timeout=once)
    lab.probe(b.netns, [tcp("198.18.1.1", 2222), tcp("198.18.3.1", 2222)], timeout=once)
    after = await read_counters(cfg.tag, netns=lab.host)
    assert after[a.sandbox_id].allowed == 2 and after[a.sandbox_id].denied >= 1
    assert after[b.sandbox_id].allowed == 1 and after[b.sandbox_id].denied >= 1


async def test_read_back_matches_render(
    lab: Lab, cfg: TableConfig, guests: dict[str, Guest]
) -> None:
    a, b = guests["a"], guests["b"]
    await install(
        lab,
        cfg,
        [sandbox(a, ["198.18.1.1", "198.18.2.0/24:8080", "good.test"]), sandbox(b)],
        {NET: [a.address, b.address]},
    )
    items = await list_table(cfg.tag, lab.host)
    sets = {i["set"]["name"]: i["set"] for i in items if "set" in i}
    maps = {i["map"]["name"]: i["map"] for i in items if "map" in i}
    key = a.sandbox_id[3:]
    assert sets[f"a_{key}_ip"]["elem"] == ["198.18.1.1"]
    assert sets[f"a_{key}_ipport"]["elem"] == [
        {"concat": [{"prefix": {"addr": "198.18.2.0", "len": 24}}, 8080]}
    ]
    assert set(sets["taps"]["elem"]) == {a.tap, b.tap}
    assert sorted(sets["net_0123456789ab"]["elem"]) == sorted([str(a.address), str(b.address)])
    vmap = {e[0]: e[1] for e in maps["sb_vmap"]["elem"]}
    assert vmap[a.tap] == {"jump": {"target": f"sb_{key}"}}
    assert {"sb_" + key, "px_" + key, "egress", "forward", "peers"} <= {
        i["chain"]["name"] for i in items if "chain" in i
    }
    host = sets["host_addrs"]["elem"]
    assert "198.18.0.1" in host and {"prefix": {"addr": "127.0.0.0", "len": 8}} in host


@pytest.mark.slow
async def test_apply_timings(lab: Lab, cfg: TableConfig) -> None:
    """Apply the full table with 1, 50 and 500 sandboxes, and one policy replace on the
    500-sandbox table (printed; run with -s to see). Numbers are not asserted."""
    pool = AddressPool(cfg.pool)
    policies = [
        parse_policy([]),
        parse_policy(["deny-all"]),
        parse_policy(["198.18.1.1", "x.test"]),
    ]
    report = []
    for count in (1, 50, 500):
        sandboxes = []
        for i in range(1, count + 1):
            sid = f"sb-{i:010x}aa"
            sandboxes.append(
                SandboxNet(sid, tap_name(cfg.tag, sid), pool.block(i).guest, policies[i % 3])
            )
        state = RulesetState(cfg, frozenset({IPv4Address("198.18.0.1")}), tuple(sandboxes))
        script = render_table(state)
        started = time.perf_counter()
        await apply(script, netns=lab.host)
        report.append(f"full table, {count} sandboxes: {time.perf_counter() - started:.3f}s")
    replace = render_replace_policy(
        cfg,
        SandboxNet(
            sandboxes[7].sandbox_id,
            sandboxes[7].tap,
            sandboxes[7].guest,
            parse_policy(["198.18.3.1", "198.18.2.0/24:443"]),
        ),
    )
    started = time.perf_counter()
    await apply(replace, netns=lab.host)
    report.append(f"policy replace on 500: {time.perf_counter() - started:.3f}s")
    print("\n" + "\n".join(report))


async def test_the_qemu_user_gets_no_network(lab: Lab, cfg: TableConfig) -> None:
    """A QEMU that escaped its guest runs as the unprivileged QEMU user: whatever it
    tries to reach from the host is dropped, while the host itself is unaffected."""
    user = "hutch-qemu" if _user_exists("hutch-qemu") else "nobody"
    control = lab.probe(lab.host, [tcp("198.18.1.1", 80)], user=user)
    assert reached(control[0], "internet"), "without the table that user gets through"
    await apply(
        render_table(RulesetState(dataclasses.replace(cfg, vmm_uid=pwd.getpwnam(user).pw_uid))),
        netns=lab.host,
    )
    assert reached(lab.probe(lab.host, [tcp("198.18.1.1", 80)])[0], "internet")
    as_qemu = lab.probe(lab.host, [tcp("198.18.1.1", 80), udp("198.18.3.1", 9999)], user=user)
    assert all(blocked(r) for r in as_qemu), as_qemu


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
