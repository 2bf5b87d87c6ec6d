"""Fixtures of the nftables dataplane tests (the lab itself: ``tests/privileged/conftest.py``).

The files of this package share one lab and one set of guests, as they did when they
were one module: building a lab costs seconds, and every test starts from a fresh table
(``_no_table_left``) all the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from ipaddress import IPv4Network

import pytest

from hutch.net.nft_apply import delete_table
from hutch.net.nft_common import TableConfig
from tests.privileged.conftest import HOST_PORTS, Guest, Lab, built_lab


@pytest.fixture(scope="package")
def lab() -> Iterator[Lab]:
    with built_lab() as lab:
        yield lab


@pytest.fixture(scope="package")
def guests(lab: Lab) -> dict[str, Guest]:
    a = lab.add_guest("a", 1)
    b = lab.add_guest("b", 2)
    rogue = lab.add_guest("r", 3, register_name=False)
    for guest in (a, b):
        lab.serve(guest.netns, guest.name, ["tcp:2222", "tcp:80"])
    return {"a": a, "b": b, "rogue": rogue}


@pytest.fixture
def cfg(lab: Lab) -> Iterator[TableConfig]:
    config = TableConfig(
        tag=lab.tag,
        pool=IPv4Network("10.213.0.0/16"),
        dns_port=HOST_PORTS["dns"],
        proxy_port=HOST_PORTS["proxy"],
        nflog_group=7,
    )
    yield config
    # Each test starts from a fresh table; the last one leaves none behind.


@pytest.fixture(autouse=True)
async def _no_table_left(lab: Lab) -> AsyncIterator[None]:
    yield
    await delete_table(lab.tag, netns=lab.host)
