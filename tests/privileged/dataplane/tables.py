"""What the nftables dataplane tests share: sandboxes and their tables, probes and how to
read a probe's answer (see ``tests/privileged/conftest.py`` for the lab)."""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Address

from hutch.net.addressing import host_addresses
from hutch.net.nft import RulesetState, render_table
from hutch.net.nft_apply import apply
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.rules import parse_policy
from tests.privileged.conftest import Guest, Lab

NET = "net-0123456789ab"


def sandbox(guest: Guest, rules: Sequence[str] = ()) -> SandboxNet:
    return SandboxNet(guest.sandbox_id, guest.tap, guest.address, parse_policy(list(rules)))


async def install(
    lab: Lab,
    cfg: TableConfig,
    sandboxes: Sequence[SandboxNet],
    networks: dict[str, list[IPv4Address]] | None = None,
) -> None:
    state = RulesetState(
        config=cfg,
        host_addrs=await host_addresses(lab.host),
        sandboxes=tuple(sandboxes),
        networks=networks or {},
    )
    await apply(render_table(state), netns=lab.host)


def tcp(host: str, port: int, src: str | None = None) -> dict[str, object]:
    return {"proto": "tcp", "host": host, "port": port, "src": src}


def udp(host: str, port: int) -> dict[str, object]:
    return {"proto": "udp", "host": host, "port": port}


def reached(result: str, label: str) -> bool:
    return result.startswith(label + " ")


def blocked(result: str) -> bool:
    return result.startswith("FAIL:")
