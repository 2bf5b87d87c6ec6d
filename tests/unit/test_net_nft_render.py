"""The nft script renderer (hutch.net.nft, nft_common, nft_sandbox, nft_tunnel): pure, so
checked as text here; the privileged tests apply the same scripts and send packets
through them."""

from __future__ import annotations

import re
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network

import pytest

from hutch.config import NetLimits
from hutch.errors import InvalidArgument
from hutch.net.nft import (
    RulesetState,
    network_key,
    render_host_addrs,
    render_networks,
    render_table,
)
from hutch.net.nft_common import SandboxNet, TableConfig, table_name
from hutch.net.nft_sandbox import (
    KEEP_S,
    LearnedAddress,
    policy_mark,
    render_add_sandbox,
    render_learned,
    render_remove_sandbox,
    render_replace_policy,
)
from hutch.net.rules import parse_policy

CFG = TableConfig(
    "ab12", IPv4Network("10.213.0.0/16"), dns_port=5353, proxy_port=8443, nflog_group=7
)
SID = "sb-0123456789ab"
KEY = "0123456789ab"


def sb(rules: list[str], sid: str = SID, guest: str = "10.213.0.6") -> SandboxNet:
    return SandboxNet(sid, "hab12" + sid[3:13], IPv4Address(guest), parse_policy(rules))


def chain_rules(script: str, chain: str) -> list[str]:
    prefix = f"add rule inet hutch_ab12 {chain} "
    return [line[len(prefix) :] for line in script.splitlines() if line.startswith(prefix)]


def test_config_is_validated() -> None:
    with pytest.raises(InvalidArgument):
        TableConfig("xyz!", IPv4Network("10.0.0.0/16"), 53, 80, 1)
    with pytest.raises(InvalidArgument):
        TableConfig("ab12", IPv4Network("10.0.0.0/16"), 0, 80, 1)
    with pytest.raises(InvalidArgument):
        TableConfig("ab12", IPv4Network("10.0.0.0/16"), 53, 80, 70000)
    assert table_name("ab12") == "hutch_ab12" == CFG.table


def test_full_table_replaces_itself_in_one_script() -> None:
    state = RulesetState(CFG, frozenset({IPv4Address("192.0.2.1")}), (sb([]),))
    script = render_table(state)
    lines = script.splitlines()
    # delete-if-exists: `add` makes the `delete` safe on a host without the table.
    assert lines[:2] == ["add table inet hutch_ab12", "delete table inet hutch_ab12"]
    assert "table inet hutch_ab12 {" in lines
    for hook in ("prerouting", "input", "forward", "postrouting"):
        assert f"chain {hook} {{" in script
    assert "udp dport 53 redirect to :5353" in script
    assert "tcp dport 53 redirect to :5353" in script
    assert 'iifname "hab12*" jump egress' in script
    assert "ip saddr @pool oifname != @taps masquerade" in script
    assert "elements = { 10.213.0.0/16 }" in script
    assert "elements = { 127.0.0.0/8, 192.0.2.1 }" in script  # loopback always included
    assert 'add element inet hutch_ab12 taps { "hab120123456789" }' in script
    assert f'"hab120123456789" : jump sb_{KEY}' in script
    assert f'"hab120123456789" : "c_{KEY}_deny"' in script
    assert '"hab120123456789" . 10.213.0.6' in script
    # Never touches anything but its own table.
    assert not re.search(r"\b(flush|delete) ruleset\b", script)
    assert set(re.findall(r"inet (\w+)", script)) == {"hutch_ab12"}


def test_object_names_are_nft_safe() -> None:
    state = RulesetState(
        CFG,
        frozenset(),
        (sb(["198.18.1.1", "x.test:443"]), sb([], "sb-ba9876543210", "10.213.0.10")),
        {"net-0123456789ab": [IPv4Address("10.213.0.6"), IPv4Address("10.213.0.10")]},
    )
    script = render_table(state)
    names = re.findall(r"^\s*(?:set|map|chain) (\S+) \{", script, re.MULTILINE)
    names += re.findall(r"add (?:set|chain|counter) inet hutch_ab12 (\S+)", script)
    assert len(names) > 20
    for name in names:
        assert re.fullmatch(r"[a-z_][a-z0-9_]{0,63}", name), name


def mark(rules: list[str]) -> str:
    return f"{policy_mark(parse_policy(rules)):#010x}"


def test_open_policy_accepts_with_counter_and_no_proxy() -> None:
    script = render_add_sandbox(CFG, sb([]))
    assert chain_rules(script, f"sb_{KEY}") == [
        f'ct mark set {mark([])} counter name "c_{KEY}_allow" accept',
        f'counter name "c_{KEY}_deny"',
        "update @log_budget { iifname limit rate over 20/second burst 40 packets } "
        f'counter name "c_{KEY}_nolog" drop',
        f'log group 7 prefix "hab12 {SID} policy" drop',
    ]
    assert chain_rules(script, f"px_{KEY}") == []
    assert chain_rules(script, f"e_{KEY}") == [f"ct mark {mark([])} accept"]


def test_policy_mark_follows_the_rules_not_the_moment() -> None:
    marks = {mark(r) for r in ([], ["deny-all"], ["good.test"], ["other.test"], ["1.2.3.4"])}
    assert len(marks) == 5 and "0x00000000" not in marks
    assert mark(["good.test", "1.2.3.4"]) == mark(["good.test", "1.2.3.4"])


def test_established_flows_pass_only_under_their_policys_mark() -> None:
    script = render_table(RulesetState(CFG, frozenset(), (sb(["good.test"]),)))
    # (Whole chains: the log budget's rules hold braces of their own.)
    egress = "\n".join(_table_chain(script, "egress"))
    ingress = "\n".join(_table_chain(script, "ingress"))
    from_tap = "\n".join(_table_chain(script, "from_tap"))
    assert "ct state established,related iifname vmap @est_vmap" in egress
    assert "ct state established,related accept" not in egress
    assert "ct state established,related oifname vmap @est_vmap" in ingress
    # Redirected DNS/proxy traffic and exposed ports: the host's own sockets.
    assert "ct state established,related accept" in from_tap
    # The spoof check still comes first.
    assert egress.index("spoof") < egress.index("est_vmap")
    assert f'"hab120123456789" : jump e_{KEY}' in script


def test_deny_all_policy_only_drops() -> None:
    rules = chain_rules(render_add_sandbox(CFG, sb(["deny-all"])), f"sb_{KEY}")
    assert rules[-1].endswith(" drop") and rules[-2].endswith(" drop")
    assert not any("accept" in r for r in rules)


def test_rules_policy_sets_and_proxy() -> None:
    policy = [
        "10.0.0.0/8",
        "10.1.0.0/16",
        "198.18.1.1",
        "198.18.2.0/24:8080",
        "198.18.2.0/25:8080",
        "198.18.3.1:53",
        "good.test",
        "2001:db8::/32",
    ]
    script = render_add_sandbox(CFG, sb(policy))
    # Overlapping intervals are collapsed (nft refuses overlaps); IPv6 rules match nothing
    # on the IPv4 path.
    assert f"add element inet hutch_ab12 a_{KEY}_ip {{ 10.0.0.0/8, 198.18.1.1 }}" in script
    assert (
        f"add element inet hutch_ab12 a_{KEY}_ipport {{ 198.18.3.1 . 53, 198.18.2.0/24 . 8080 }}"
        in script
    )
    assert "2001:db8" not in script
    rules = chain_rules(script, f"sb_{KEY}")
    m = mark(policy)
    assert rules[0] == f'ip daddr @a_{KEY}_ip ct mark set {m} counter name "c_{KEY}_allow" accept'
    quic = rules.index(f'udp dport 443 log group 7 prefix "hab12 {SID} quic" drop')
    # Counted, then past the sandbox's log budget counted as unlogged, else logged.
    assert rules[quic - 2] == f'udp dport 443 counter name "c_{KEY}_deny"'
    assert rules[quic - 1] == (
        "udp dport 443 update @log_budget { iifname limit rate over 20/second burst 40 "
        f'packets }} counter name "c_{KEY}_nolog" drop'
    )
    # Explicit ip rules come before the QUIC drop; learned addresses after it.
    assert quic - 2 > 1 and f"@a_{KEY}_dns " in rules[quic + 1]
    assert f"meta l4proto @tcp_udp ip daddr . th dport @a_{KEY}_dnsport" in rules[quic + 2]
    assert rules[quic + 3] == (
        f"ct state established,related ip daddr @a_{KEY}_keep ct mark set {m} accept"
    )
    assert f"th dport @a_{KEY}_keepport ct mark set {m} accept" in rules[quic + 4]
    assert rules[-1] == f'log group 7 prefix "hab12 {SID} policy" drop'
    assert chain_rules(script, f"px_{KEY}") == [
        f"ip daddr @a_{KEY}_ip return",
        f"ip daddr . tcp dport @a_{KEY}_ipport return",
        "tcp dport @web_ports redirect to :8443",
    ]


def test_replace_policy_is_one_flush_and_refill() -> None:
    script = render_replace_policy(
        CFG, sb(["198.18.1.1"]), [LearnedAddress(IPv4Address("198.18.3.3"), None, 30)]
    )
    lines = script.splitlines()
    assert lines[:9] == [
        f"flush set inet hutch_ab12 a_{KEY}_ip",
        f"flush set inet hutch_ab12 a_{KEY}_ipport",
        f"flush set inet hutch_ab12 a_{KEY}_dns",
        f"flush set inet hutch_ab12 a_{KEY}_dnsport",
        f"flush set inet hutch_ab12 a_{KEY}_keep",
        f"flush set inet hutch_ab12 a_{KEY}_keepport",
        f"flush chain inet hutch_ab12 sb_{KEY}",
        f"flush chain inet hutch_ab12 px_{KEY}",
        f"flush chain inet hutch_ab12 e_{KEY}",
    ]
    assert f"add rule inet hutch_ab12 e_{KEY} ct mark {mark(['198.18.1.1'])} accept" in lines
    assert f"add element inet hutch_ab12 a_{KEY}_dns {{ 198.18.3.3 timeout 30s }}" in lines
    # Nothing of any other sandbox or the shared objects is touched.
    assert all(KEY in line for line in lines), script


def test_learned_refreshes_timeouts() -> None:
    script = render_learned(
        CFG,
        SID,
        [
            LearnedAddress(IPv4Address("1.2.3.4"), None, 60),
            LearnedAddress(IPv4Address("1.2.3.5"), 443, 0, keep=0),
            LearnedAddress(IPv4Address("1.2.3.6"), None, None, keep=90),
        ],
    )
    t = "inet hutch_ab12"
    assert script.splitlines() == [
        f"add element {t} a_{KEY}_dns {{ 1.2.3.4 timeout 60s }}",
        f"delete element {t} a_{KEY}_dns {{ 1.2.3.4 }}",
        f"add element {t} a_{KEY}_dns {{ 1.2.3.4 timeout 60s }}",
        f"add element {t} a_{KEY}_keep {{ 1.2.3.4 timeout {KEEP_S}s }}",
        f"delete element {t} a_{KEY}_keep {{ 1.2.3.4 }}",
        f"add element {t} a_{KEY}_keep {{ 1.2.3.4 timeout {KEEP_S}s }}",
        f"add element {t} a_{KEY}_dnsport {{ 1.2.3.5 . 443 timeout 1s }}",
        f"delete element {t} a_{KEY}_dnsport {{ 1.2.3.5 . 443 }}",
        f"add element {t} a_{KEY}_dnsport {{ 1.2.3.5 . 443 timeout 1s }}",
        # Past its TTL: kept for established flows only.
        f"add element {t} a_{KEY}_keep {{ 1.2.3.6 timeout 90s }}",
        f"delete element {t} a_{KEY}_keep {{ 1.2.3.6 }}",
        f"add element {t} a_{KEY}_keep {{ 1.2.3.6 timeout 90s }}",
    ]
    assert render_learned(CFG, SID, []) == ""


def test_remove_sandbox_is_idempotent_by_construction() -> None:
    script = render_remove_sandbox(CFG, sb([]))
    lines = script.splitlines()
    # Every deleted object or element was `add`ed earlier in the same script.
    assert lines.index(f"add chain inet hutch_ab12 sb_{KEY}") < lines.index(
        f"delete chain inet hutch_ab12 sb_{KEY}"
    )
    assert lines.index('add element inet hutch_ab12 taps { "hab120123456789" }') < lines.index(
        'delete element inet hutch_ab12 taps { "hab120123456789" }'
    )
    # Map elements go before the chains they jump to and the counters they name.
    assert lines.index('delete element inet hutch_ab12 sb_vmap { "hab120123456789" }') < (
        lines.index(f"delete chain inet hutch_ab12 sb_{KEY}")
    )
    assert lines.index('delete element inet hutch_ab12 est_vmap { "hab120123456789" }') < (
        lines.index(f"delete chain inet hutch_ab12 e_{KEY}")
    )
    for name in ("keep", "keepport"):
        assert f"delete set inet hutch_ab12 a_{KEY}_{name}" in lines
    for kind, obj in (
        ("nolog", "nolog_ctr"), ("limit", "limit_ctr"), ("deny", "deny_ctr"), ("tx", "tx_ctr"),
    ):  # fmt: skip
        added = lines.index(f"add counter inet hutch_ab12 c_{KEY}_{kind}")
        unmapped = lines.index(f'delete element inet hutch_ab12 {obj} {{ "hab120123456789" }}')
        assert added < unmapped < lines.index(f"delete counter inet hutch_ab12 c_{KEY}_{kind}")


def _table_chain(script: str, chain: str) -> list[str]:
    body = script.split(f"  chain {chain} {{\n", 1)[1].split("\n  }", 1)[0]
    return [line.strip() for line in body.splitlines()]


def test_every_denial_draws_on_its_sandboxs_log_budget() -> None:
    """Issue 17.6: one budget per input interface, shared by every deny rule, instead of
    a limit per rule that all sandboxes share; past it the denial is counted as unlogged
    (and still dropped)."""
    state = RulesetState(CFG, frozenset(), (sb(["good.test"]),))
    script = render_table(state)
    assert "set log_budget { type ifname; flags dynamic,timeout;" in script
    budget = "update @log_budget { iifname limit rate over 20/second burst 40 packets }"
    # No limit anywhere but in a per-interface meter: nothing shared between sandboxes.
    limited = [line for line in script.splitlines() if "limit rate" in line]
    assert limited and all("{ iifname limit rate over" in line for line in limited)
    for chain in ("from_tap", "egress"):
        rules = _table_chain(script, chain)
        logs = [i for i, r in enumerate(rules) if " log group 7 " in f" {r}"]
        assert logs, chain
        for i in logs:
            match = rules[i].split("log group")[0].strip()
            assert rules[i].endswith(" drop"), rules[i]
            # Right before: past the budget -> counted as unlogged, dropped; before that
            # the count every denial gets.
            assert rules[i - 1].startswith(f"{match} {budget}".strip()), rules[i - 1]
            assert rules[i - 1].endswith(" drop")
            assert rules[i - 2].startswith(match) and "counter" in rules[i - 2]
            if "unregistered" not in rules[i]:
                assert "@nolog_ctr" in rules[i - 1] and "@deny_ctr" in rules[i - 2]
    # The sandbox's own denials (its policy, QUIC under name rules) use its budget too.
    own = chain_rules(script, f"sb_{KEY}")
    logs = [i for i, r in enumerate(own) if "log group 7" in r]
    assert len(logs) == 2
    for i in logs:
        assert own[i - 1].endswith(f'{budget} counter name "c_{KEY}_nolog" drop'), own[i - 1]
        assert own[i - 2].endswith(f'counter name "c_{KEY}_deny"'), own[i - 2]
    assert 'add element inet hutch_ab12 nolog_ctr { "hab120123456789" : ' in script


def test_resolver_and_proxy_have_kernel_ceilings_before_conntrack() -> None:
    """Issue 17.5: past twice the daemon's limits a flood is dropped in the kernel, per
    sandbox, before the established accept (a flood from one socket is established)."""
    limits = NetLimits(dns_rate=50, dns_burst=70, proxy_conn_rate=30, proxy_conn_burst=40)
    cfg = replace(CFG, limits=limits)
    script = render_table(RulesetState(cfg, frozenset(), (sb([]),)))
    rules = _table_chain(script, "from_tap")
    dns = (
        "udp dport 5353 ct status dnat update @dns_meter { iifname limit rate over "
        "100/second burst 140 packets } counter name iifname map @limit_ctr drop"
    )
    conn = (
        "tcp dport { 5353, 8443 } ct state new ct status dnat update @conn_meter { iifname "
        "limit rate over 60/second burst 80 packets } counter name iifname map @limit_ctr drop"
    )
    established = rules.index("ct state established,related accept")
    assert rules.index(dns) < established and rules.index(conn) < established
    # ... but after the source checks (a spoofed packet must not use another's budget).
    assert max(i for i, r in enumerate(rules) if "@tap_src" in r) < rules.index(dns)
    assert 'add element inet hutch_ab12 limit_ctr { "hab120123456789" : ' in script
    assert f"add counter inet hutch_ab12 c_{KEY}_limit" in script


def test_networks() -> None:
    a, b, c = (IPv4Address(f"10.213.0.{n}") for n in (6, 10, 14))
    script = render_networks(
        CFG, {"net-0123456789ab": [a, b, a], "net-000000000001": [c]}, removed=["net-ffffffffffff"]
    )
    lines = script.splitlines()
    assert lines[0] == "flush chain inet hutch_ab12 peers"
    assert "add element inet hutch_ab12 net_0123456789ab { 10.213.0.6, 10.213.0.10 }" in lines
    rules = chain_rules(script, "peers")
    assert rules == ["ip saddr @net_0123456789ab ip daddr @net_0123456789ab accept"]
    assert "delete set inet hutch_ab12 net_ffffffffffff" in lines
    assert network_key("net-0123456789ab") == "net_0123456789ab"
    with pytest.raises(InvalidArgument):
        network_key("net-; flush ruleset")


def test_host_addrs_are_collapsed() -> None:
    script = render_host_addrs(CFG, [IPv4Address("127.0.0.1"), IPv4Address("192.0.2.1")])
    assert script.splitlines() == [
        "flush set inet hutch_ab12 host_addrs",
        "add element inet hutch_ab12 host_addrs { 127.0.0.0/8, 192.0.2.1 }",
    ]


def test_strings_cannot_break_out_of_quotes() -> None:
    bad = SandboxNet(SID, 'hab12"; flush', IPv4Address("10.213.0.6"), parse_policy([]))
    with pytest.raises(InvalidArgument):
        render_add_sandbox(CFG, bad)
    with pytest.raises(InvalidArgument):
        render_add_sandbox(CFG, sb([], sid="sb-not-hex"))


def test_traffic_from_the_qemu_user_is_dropped_only_when_configured() -> None:
    plain = render_table(RulesetState(CFG))
    assert "hook output" not in plain and "skuid" not in plain
    jailed = render_table(RulesetState(replace(CFG, vmm_uid=995)))
    assert "type filter hook output priority filter; policy accept;" in jailed
    assert "meta skuid 995 counter drop" in jailed
    for bad in (0, -1, 1 << 32):
        with pytest.raises(InvalidArgument, match="vmm_uid"):
            replace(CFG, vmm_uid=bad)


def test_forwarded_bytes_are_counted_per_sandbox_after_the_filter() -> None:
    """The meter's egress bytes: what left the host from a tap (not to another tap), after
    the forward filter accepted it, counted in the sandbox's own tx counter."""
    script = render_table(
        RulesetState(config=CFG, host_addrs=frozenset(), sandboxes=(sb([]),), networks={})
    )
    assert _table_chain(script, "sent") == [
        "type filter hook postrouting priority filter; policy accept;",
        "iifname @taps oifname != @taps counter name iifname map @tx_ctr",
    ]
    assert f'add element inet hutch_ab12 tx_ctr {{ "hab120123456789" : "c_{KEY}_tx" }}' in script


def test_an_observing_policy_is_open_but_proxies_web_traffic() -> None:
    """Learn and dry run: every packet passes, but tcp 80/443 goes through the proxy,
    which records what the policy would deny."""
    from hutch.net.rules import policy_from_stored

    for doc in (
        {"inspection": "learn"},
        {"dry_run": True, "rules": [{"action": "allow", "host": "a.test"}]},
    ):
        policy = policy_from_stored(doc)
        assert policy.mode == "open" and policy.observe is not None
        script = render_add_sandbox(CFG, replace(sb([]), policy=policy))
        assert chain_rules(script, f"px_{KEY}") == ["tcp dport @web_ports redirect to :8443"]
        assert chain_rules(script, f"sb_{KEY}")[0].endswith("accept")
    assert policy_from_stored({"dry_run": True, "rules": []}).shadow().mode == "deny-all"


def test_default_allow_with_denies_drops_them_after_earlier_allows_and_proxies_names() -> None:
    """Default allow with deny rules: the allow rules before the ip/cidr denies are
    accepted first (first match wins), the denies dropped and logged as the policy's,
    QUIC dropped (names are checked by SNI on TCP only), then everything accepted; web
    traffic goes through the proxy, which decides the name denies by SNI and Host."""
    from hutch.net.rules import policy_from_stored

    doc = {
        "default": "allow",
        "rules": [
            {"action": "allow", "host": "198.18.0.5"},
            {"action": "deny", "host": "198.18.0.0/24"},
            {"action": "deny", "host": "198.18.1.0/24:22"},
            {"action": "deny", "host": "evil.test"},
        ],
    }
    policy = policy_from_stored(doc)
    script = render_add_sandbox(CFG, replace(sb([]), policy=policy))
    rules = chain_rules(script, f"sb_{KEY}")
    m = f"{policy_mark(policy):#010x}"
    assert f"add element inet hutch_ab12 a_{KEY}_ip {{ 198.18.0.5 }}" in script
    assert rules[0] == f'ip daddr @a_{KEY}_ip ct mark set {m} counter name "c_{KEY}_allow" accept'
    drop_any = rules.index(
        f'ip daddr {{ 198.18.0.0/24 }} log group 7 prefix "hab12 {SID} policy" drop'
    )
    drop_22 = rules.index(
        "meta l4proto @tcp_udp ip daddr . th dport { 198.18.1.0/24 . 22 } "
        f'log group 7 prefix "hab12 {SID} policy" drop'
    )
    quic = rules.index(f'udp dport 443 log group 7 prefix "hab12 {SID} quic" drop')
    accept = rules.index(f'ct mark set {m} counter name "c_{KEY}_allow" accept')
    assert 0 < drop_any < drop_22 < quic < accept
    assert chain_rules(script, f"px_{KEY}") == [
        f"ip daddr @a_{KEY}_ip return",
        f"ip daddr . tcp dport @a_{KEY}_ipport return",
        "tcp dport @web_ports redirect to :8443",
    ]
    # Only ip denies: no name to check, so no proxy and no QUIC drop.
    only_ip = policy_from_stored({"default": "allow", "rules": doc["rules"][:3]})
    script = render_add_sandbox(CFG, replace(sb([]), policy=only_ip))
    assert chain_rules(script, f"px_{KEY}") == []
    assert not any("quic" in r for r in chain_rules(script, f"sb_{KEY}"))


def test_default_allow_with_full_inspection_lets_only_the_proxied_web_out() -> None:
    from hutch.net.rules import policy_from_stored

    policy = policy_from_stored({"default": "allow", "inspection": "full"})
    script = render_add_sandbox(CFG, replace(sb([]), policy=policy))
    rules = chain_rules(script, f"sb_{KEY}")
    assert not any("accept" in r for r in rules), rules  # non-HTTP TCP and UDP: dropped
    assert chain_rules(script, f"px_{KEY}")[-1] == "tcp dport @web_ports redirect to :8443"
