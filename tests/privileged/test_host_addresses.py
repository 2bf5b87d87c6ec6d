""" "Is this the host?" against a real kernel, in a scratch network namespace: the route
lookup sees an address the moment it is added, and the watcher reports every change."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .conftest import require_tools, sh

pytestmark = pytest.mark.privileged

SRC = Path(__file__).resolve().parents[2] / "src"

# Runs inside the namespace: prints the watcher's sets as they change, and answers
# "is <addr> the host?" for each address read from stdin.
AGENT = r"""
import asyncio, json, sys
from ipaddress import IPv4Address
from hutch.net.addressing import host_addresses
from hutch.net.host_addresses import HostAddressWatcher, is_host_address

def say(obj):
    print(json.dumps(obj), flush=True)

async def main():
    async def changed(addrs):
        say({"set": sorted(map(str, addrs))})
    watcher = HostAddressWatcher(host_addresses, changed)
    say({"set": sorted(map(str, await watcher.start()))})
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        say({"host": is_host_address(IPv4Address(line.strip()))})
    await watcher.close()

asyncio.run(main())
"""


class Agent:
    def __init__(self, ns: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-c", AGENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        #: Set reports that arrived while a question was waiting for its answer: the
        #: watcher may report a change before the answer to the question asked after it.
        self.sets: list[object] = []

    def next(self) -> dict[str, object]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the agent in the namespace died"
        answer: dict[str, object] = json.loads(line)
        return answer

    def is_host(self, addr: str) -> object:
        assert self.proc.stdin is not None
        self.proc.stdin.write(addr + "\n")
        self.proc.stdin.flush()
        while "host" not in (answer := self.next()):
            self.sets.append(answer["set"])  # a set report that raced the question
        return answer["host"]

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        finally:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()

    def next_set(self) -> object:
        if self.sets:
            return self.sets.pop(0)
        while "set" not in (answer := self.next()):
            pass
        return answer["set"]


@pytest.fixture
def netns() -> Iterator[str]:
    require_tools()
    name = f"hxha{secrets.token_hex(3)}"
    sh("ip", "netns", "add", name)
    try:
        sh("ip", "-n", name, "link", "set", "lo", "up")
        sh("ip", "-n", name, "link", "add", "up0", "type", "veth", "peer", "name", "up1")
        sh("ip", "-n", name, "addr", "add", "198.18.0.1/24", "dev", "up0")
        sh("ip", "-n", name, "link", "set", "up0", "up")
        yield name
    finally:
        sh("ip", "netns", "del", name, check=False)


def test_route_lookup_and_watcher_follow_address_changes(netns: str) -> None:
    agent = Agent(netns)
    try:
        assert agent.next_set() == ["127.0.0.1", "198.18.0.1"]
        assert agent.is_host("198.18.0.1") is True
        assert agent.is_host("198.18.0.255") is True  # the subnet's broadcast stays here
        assert agent.is_host("198.18.0.2") is False  # a neighbour on the link
        assert agent.is_host("203.0.113.7") is False  # no route at all
        sh("ip", "-n", netns, "addr", "add", "203.0.113.7/32", "dev", "up0")
        assert agent.is_host("203.0.113.7") is True  # at once, whatever the watcher does
        assert agent.next_set() == ["127.0.0.1", "198.18.0.1", "203.0.113.7"]
        sh("ip", "-n", netns, "addr", "del", "203.0.113.7/32", "dev", "up0")
        assert agent.next_set() == ["127.0.0.1", "198.18.0.1"]
        assert agent.is_host("203.0.113.7") is False
    finally:
        agent.close()
