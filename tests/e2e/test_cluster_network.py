"""A private network across two hosts: two hutchd workers on this machine sharing one
database (one WAL SQLite file), a member on each reaching the other by name over the
overlay hutch sets up (hutch.net.tunnel: a VXLAN device per worker, its own UDP port,
mark and routing table, so the two share this machine's network namespace as two
machines would not need to), a sandbox off the network on the first worker reaching
neither; the overlay rebuilt after a worker is SIGKILLed and restarted; nothing left
(devices, fdb entries, ip rules, nft tables) when the members go and the workers stop.

Three 128 MiB sandboxes, each restored from its worker's template of the base image.
The bring-up is this file's own (the two-worker cluster of tests/e2e/test_cluster.py,
on SQLite and with tunnel ports).
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from hutch.config import load_settings
from hutch.images.build import ImageArtifacts
from hutch.sdk import Client, SandboxInfo
from tests.e2e.conftest import _LIVE, Daemon, finalize_daemon, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.vm]

MEMORY_MIB = 128
PORT = 8000
#: Seconds for a member on one worker to be known on the other (a poll is 1 s).
LEARN_S = 10.0


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Worker(Daemon):
    def __init__(self, state_dir: Path, host_id: str, shared: Path) -> None:
        super().__init__(state_dir)
        self.host_id = host_id
        self.daemon_env.pop("HUTCH_DATABASE_URL", None)  # this cluster shares a file
        self.daemon_env.update(
            {
                "HUTCH_ROLE": "worker",
                "HUTCH_HOST_ID": host_id,
                "HUTCH_SHARED_DB": str(shared / "cluster.db"),
                "HUTCH_CLUSTER_SECRET_FILE": str(shared / "cluster-secret"),
                "HUTCH_TUNNEL_PORT": str(_free_udp_port()),
            }
        )
        self.settings = load_settings(self.daemon_env)

    @property
    def tunnel(self) -> str:
        return f"hx{self.settings.daemon_tag}"

    @property
    def route_table(self) -> str:
        return str(0x68780000 | int(self.settings.daemon_tag, 16))


@pytest.fixture(scope="module")
def workers(
    base_image: ImageArtifacts, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Worker]]:
    root = tmp_path_factory.mktemp("cluster-net")
    shared = root / "shared"
    shared.mkdir()
    (shared / "cluster-secret").write_text(secrets.token_hex(32) + "\n")
    (shared / "cluster-secret").chmod(0o600)
    made = [Worker(root / f"state-{h}", h, shared) for h in ("w1", "w2")]
    assert made[0].settings.net_pool != made[1].settings.net_pool
    key = "hk_" + secrets.token_urlsafe(32)
    for w in made:
        w.state_dir.mkdir(parents=True)
        (w.state_dir / "api-key").write_text(key + "\n")
        (w.state_dir / "api-key").chmod(0o600)
        _LIVE.append(w)
    made[0].start()  # migrates the shared database; then the secrets key is shared
    shutil.copy(made[0].state_dir / "secrets.key", made[1].state_dir / "secrets.key")
    made[1].start()
    yield made
    problems: list[str] = []
    for w in made:
        problems += finalize_daemon(w)  # also reports a tunnel device or ip rule left
    assert not problems, "\n".join(problems)


def _sh(c: Client, sandbox_id: str, script: str, timeout: float = 60.0) -> tuple[int, str]:
    result = c.exec(sandbox_id, ["sh", "-c", script], timeout_s=timeout)
    return (result.exit_code if result.exit_code is not None else -1), result.stdout + result.stderr


def _resolve(c: Client, sandbox_id: str, name: str) -> str:
    code, out = _sh(
        c, sandbox_id, f"python3 -c \"import socket; print(socket.gethostbyname('{name}'))\""
    )
    return out.strip() if code == 0 else ""


def _fetch(c: Client, sandbox_id: str, target: str) -> str:
    """The body of http://TARGET:PORT/marker from inside the guest ('' when it fails)."""
    code, out = _sh(
        c,
        sandbox_id,
        'python3 -c "import urllib.request as u; '
        f"print(u.urlopen('http://{target}:{PORT}/marker', timeout=4).read().decode())\"",
    )
    return out.strip() if code == 0 else ""


def _serve(c: Client, sandbox: SandboxInfo) -> None:
    c.exec(sandbox.id, ["sh", "-c", f"echo {sandbox.id} > /tmp/marker"])
    c.exec(
        sandbox.id,
        ["sh", "-c", f"setsid -f python3 -m http.server {PORT} --directory /tmp >/dev/null 2>&1"],
    )
    assert wait_for(lambda: _fetch(c, sandbox.id, "127.0.0.1") == sandbox.id, 30)


def _address(sb: SandboxInfo) -> str:
    assert sb.network is not None and sb.network.address, sb
    return sb.network.address


def _link(name: str) -> dict[str, object] | None:
    done = subprocess.run(
        ["ip", "-j", "-s", "link", "show", "dev", name], capture_output=True, text=True
    )
    if done.returncode != 0:
        return None
    links: list[dict[str, object]] = json.loads(done.stdout)
    return links[0]


def _tx_packets(name: str) -> int:
    link = _link(name)
    assert link is not None, f"no device {name}"
    stats = link["stats64"]
    assert isinstance(stats, dict)
    return int(stats["tx"]["packets"])


def _rules_of(w: Worker) -> int:
    rules = subprocess.run(["ip", "rule", "show"], capture_output=True, text=True).stdout
    return sum(1 for line in rules.splitlines() if f"lookup {w.route_table}" in line)


def _routes_of(w: Worker) -> str:
    return subprocess.run(
        ["ip", "route", "show", "table", w.route_table], capture_output=True, text=True
    ).stdout.strip()


@pytest.mark.timeout(600)
def test_members_on_two_workers_reach_each_other_by_name_and_nobody_else_does(
    workers: list[Worker],
) -> None:
    w1, w2 = workers
    with w1.client(timeout=300.0) as c1, w2.client(timeout=300.0) as c2:
        net = c1.networks.create("team").id
        alpha = c1.create_sandbox(
            memory_mib=MEMORY_MIB, name="alpha", networks=[net], placement={"host": "w1"}
        )
        # Egress rules hold across hosts: bravo may reach nothing but its peers.
        bravo = c2.create_sandbox(
            memory_mib=MEMORY_MIB,
            name="bravo",
            networks=[net],
            egress=["deny-all"],
            placement={"host": "w2"},
        )
        charlie = c1.create_sandbox(memory_mib=MEMORY_MIB, name="charlie", placement={"host": "w1"})
        assert w1.sandbox_qemus().keys() >= {alpha.id, charlie.id}
        assert bravo.id in w2.sandbox_qemus()
        a_addr, b_addr, c_addr = (_address(sb) for sb in (alpha, bravo, charlie))
        for c, sb in ((c2, bravo), (c1, alpha), (c1, charlie)):
            _serve(c, sb)

        # By name, both ways, over the tunnel: each worker's device carries the packets.
        assert wait_for(lambda: _resolve(c1, alpha.id, "bravo") == b_addr, LEARN_S)
        assert _resolve(c1, alpha.id, f"{bravo.id}.hutch.internal") == b_addr
        sent_1, sent_2 = _tx_packets(w1.tunnel), _tx_packets(w2.tunnel)
        assert wait_for(lambda: _fetch(c1, alpha.id, "bravo") == bravo.id, LEARN_S)
        assert _resolve(c2, bravo.id, "alpha") == a_addr
        assert _fetch(c2, bravo.id, "alpha") == alpha.id  # deny-all, but a peer
        assert _tx_packets(w1.tunnel) > sent_1 and _tx_packets(w2.tunnel) > sent_2
        assert f"{b_addr} dev {w1.tunnel}" in _routes_of(w1)
        assert _rules_of(w1) == 1 and _rules_of(w2) == 1
        # bravo's own rules still hold: nothing but its peers (charlie serves, no peer).
        assert _fetch(c2, bravo.id, c_addr) == ""

        # Off the network, on alpha's worker: bravo neither resolves nor answers.
        assert _resolve(c1, charlie.id, "bravo") == ""
        assert _fetch(c1, charlie.id, b_addr) == ""
        assert _fetch(c1, charlie.id, a_addr) == ""  # nor alpha next to it

        # w1 SIGKILLed: its device stays behind; the restart removes it and builds the
        # overlay again (alpha adopted with its VM).
        w1.kill9()
        assert _link(w1.tunnel) is not None
        w1.start()
        assert wait_for(lambda: _fetch(c1, alpha.id, "bravo") == bravo.id, LEARN_S)
        assert _rules_of(w1) == 1

        # bravo goes: w1's route goes (and with the last route the device).
        c2.delete_sandbox(bravo.id)
        assert wait_for(lambda: _link(w1.tunnel) is None, LEARN_S)
        assert _link(w2.tunnel) is None
        assert _routes_of(w1) == "" and _rules_of(w1) == 0
        assert _resolve(c1, alpha.id, "bravo") == ""
        for sb in (alpha, charlie):
            c1.delete_sandbox(sb.id)
        c1.networks.delete(net)
