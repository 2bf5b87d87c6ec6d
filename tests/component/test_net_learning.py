"""Rule changes against what is in flight in the data path's thread (issues 16 and 17.5).

The resolver learns answers into nft and the manager swaps a sandbox's policy in the
same sets, from two event loops' worth of callers. These tests hold one side in the
middle of its work and check that the other waits or re-checks: an answer being learned
while the rules change never ends up in the new sets for a name the new rules dropped,
and a proxied connection decided under the old rules is cut when it registers.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from hutch.config import NetLimits, Settings
from hutch.net.dataplane import MemoryDataplane
from hutch.net.dns import SandboxNetInfo
from hutch.net.egress_log import EgressLog
from hutch.net.nft_common import SandboxNet, TableConfig
from hutch.net.nft_sandbox import LearnedAddress
from hutch.net.proxy import EgressProxy
from hutch.net.rules import parse_policy
from hutch.services.network import NetworkService
from hutch.store import Store
from tests.component.test_net_dns import Directory, FakeUpstream, upstream
from tests.component.test_net_flood import ask

__all__ = ["upstream"]  # the fixture, imported for its name

# The data path's code, on the data path's loop (tests/conftest.py).
pytestmark = [pytest.mark.timeout(60), pytest.mark.datapath_loop]

SID = "sb-bbbbbbbbbbbb"
GOOD = IPv4Address("198.18.0.10")  # good.test in the fake upstream's zone


class GatedDataplane(MemoryDataplane):
    """Learning waits at a gate the test opens; the order of learnings and swaps is
    recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.calls: list[str] = []

    async def learned(
        self, cfg: TableConfig, sandbox_id: str, items: Iterable[LearnedAddress]
    ) -> None:
        self.calls.append("learned")
        self.entered.set()
        await asyncio.to_thread(self.gate.wait, 10)
        await super().learned(cfg, sandbox_id, items)

    async def replace_policy(
        self, cfg: TableConfig, sb: SandboxNet, learned: Iterable[LearnedAddress] = ()
    ) -> None:
        self.calls.append("replace")
        await super().replace_policy(cfg, sb, learned)


@pytest.fixture
async def gated(
    tmp_path: Path, upstream: FakeUpstream
) -> AsyncIterator[tuple[NetworkService, GatedDataplane]]:
    settings = Settings(
        state_dir=tmp_path,
        net_pool=IPv4Network("127.77.0.0/24"),  # inside 127/8: the test sends from it
        dns_upstream=("127.0.0.53", upstream.port),
        net_limits=replace(NetLimits()),
    )
    dataplane = GatedDataplane()
    manager = NetworkService(settings, Store(settings.database), lambda _s: None, dataplane)
    await manager.start([])
    await manager.attach(SID, parse_policy(["good.test"]))
    yield manager, dataplane
    dataplane.gate.set()
    await manager.detach(SID)
    await manager.close()


async def test_a_rule_change_waits_for_a_learning_in_flight_and_then_drops_it(
    gated: tuple[NetworkService, GatedDataplane],
) -> None:
    net, dataplane = gated
    address = net.address_of(SID)
    assert address is not None
    answer = asyncio.create_task(
        asyncio.to_thread(ask, str(address), net.enforcer.resolver.port, "good.test")
    )
    assert await asyncio.to_thread(dataplane.entered.wait, 5), "the answer is being learned"
    change = asyncio.create_task(net.set_policy(SID, parse_policy(["other.test"])))
    await asyncio.sleep(0.3)
    assert not change.done() and dataplane.calls == ["learned"], "the swap waits its turn"
    dataplane.gate.set()
    await change
    assert await answer == "NOERROR"
    # The learning finished first; the swap then flushed it (the new rules drop the name).
    assert dataplane.calls == ["learned", "replace"]
    assert dataplane.learned_items[SID] == []
    # An answer decided under the old rules and handed over after the change is not
    # learned into the new sets.
    await net.enforcer.datapath.run(
        net.enforcer.learner.learn(SID, [(GOOD, None)], 30, "good.test")
    )
    assert dataplane.calls == ["learned", "replace"]
    assert dataplane.learned_items[SID] == []


async def test_a_connection_decided_under_old_rules_is_cut_when_it_registers() -> None:
    """revalidate() cuts the relays registered when the rules change; one still being
    decided then (here: its name still resolving) is checked when it registers."""

    async def web(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nsecret")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(web, "127.0.0.20", 0)
    web_port = server.sockets[0].getsockname()[1]
    resolving, release = asyncio.Event(), asyncio.Event()

    class SlowNames:
        async def resolve_a(self, name: str) -> list[tuple[IPv4Address, int]]:
            resolving.set()
            await release.wait()
            return [(IPv4Address("127.0.0.20"), 60)]

    src = IPv4Address("127.0.0.2")
    directory = Directory({src: SandboxNetInfo(SID, parse_policy(["good.test"]))})
    log = EgressLog()
    proxy = EgressProxy(
        directory, SlowNames(), log, lambda _a: None, original_port=lambda _s: web_port
    )
    port = await proxy.start("127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=(str(src), 0))
        writer.write(b"GET / HTTP/1.0\r\nHost: good.test\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(resolving.wait(), 5)
        new = parse_policy(["other.test"])
        directory.entries[src] = SandboxNetInfo(SID, new)
        assert proxy.revalidate(SID, new) == 0, "nothing registered yet"
        release.set()
        got = b""
        with contextlib.suppress(ConnectionError):
            got = await asyncio.wait_for(reader.read(), 5)
        assert b"secret" not in got
        writer.close()
        last = log.events(SID)[-1]
        assert (last.verdict, last.name) == ("deny", "good.test")
        assert "rules changed" in last.reason and "no rule allows good.test" in last.reason
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()
