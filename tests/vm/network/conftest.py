"""The package's shared lab: one daemon (its own state dir, address pool and
``HUTCH_DNS_UPSTREAM`` pointing at the package's ``FakeInternet``) and one long-lived
sandbox, ``alpha``, whose rules change live between checks. The guest runs
``tests/netfake/probe.py`` with a batch of checks at once, and each check says whether
that connection or lookup should work. What reached the fake internet is read from its
server logs, so a bypass that "failed" inside the guest but leaked a query or request
outside still fails the test.

Package scope, not module scope: the tests are split by what they check (egress rules;
private networks, lifecycle, inbound ports and the daemon's restart) but boot the
daemon and ``alpha`` once. ``test_rules_hold_across_a_daemon_restart_and_delete_reclaims``
restarts the daemon: it is the last test of the package's last module.

Nothing but the fake internet's addresses (198.18.x.0/24, 2001:2:0:x::/64) is contacted.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from hutch.errors import HutchError
from hutch.sdk import Client
from tests.e2e.conftest import Daemon
from tests.netfake import FakeInternet
from tests.vm.netlab import Guest, make_guest, network_daemon


@pytest.fixture(scope="package")
def fakenet() -> Iterator[FakeInternet]:
    """The package's fake internet (tests/vm/conftest.py's, for the whole package)."""
    with FakeInternet() as net:
        yield net


@pytest.fixture(scope="package")
def netd(fakenet: FakeInternet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    with network_daemon(tmp_path_factory.mktemp("hutchd-net"), fakenet) as d:
        yield d


@pytest.fixture(scope="package")
def client(netd: Daemon) -> Iterator[Client]:
    with netd.client(timeout=300.0) as c:
        yield c


@pytest.fixture(scope="package")
def lab_net(client: Client) -> str:
    return client.networks.create("lab").id


@pytest.fixture(scope="package")
def alpha(client: Client, fakenet: FakeInternet, lab_net: str) -> Iterator[Guest]:
    """The package's main sandbox: open egress at create, on private network ``lab``."""
    guest = make_guest(client, fakenet, "alpha", networks=[lab_net])
    yield guest
    with contextlib.suppress(HutchError):
        guest.sb.kill()
