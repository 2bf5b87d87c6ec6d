"""``FakeInternet``: a network namespace that plays the internet for network tests.

Topology (``k`` is a free /24 picked per instance so parallel runs never collide)::

    host  fnh-XXXXXX 198.18.k.1/24, 2001:2:0:k::1/64  (routes via the connected prefix)
      |  veth
    netns hfn-<pid>-XXXX  fnn-XXXXXX
          198.18.k.10  good.test www.good.test other.test doh.test   (HTTP 80, HTTPS 443)
          198.18.k.20  cdn2.test
          198.18.k.53  the DNS server hutch forwards to (HUTCH_DNS_UPSTREAM)
          198.18.k.99  a rogue resolver that answers anything
          10.254.k.3   a "LAN" host (private address; the host routes this /32 here)
          2001:2:0:k::10  good.test (AAAA) / v6only.test
    198.19.k.77    not configured anywhere: a test adds it to the host itself
                   (``late_host``) to play an address that appears after hutchd started

198.18.0.0/15 (RFC 2544) and 2001:2::/48 (RFC 5180) are benchmarking ranges: never routed
anywhere real, and not "private" for hutch's DNS-rebinding check. Everything made here
(netns, veth, the server process) is removed on exit, also when the body raised; namespaces
left by a killed earlier run (its pid is gone) are removed on the next start.

Every request or DNS query that reaches a fake server is recorded: :meth:`events`.
Needs root (``ip netns``) and ``openssl``.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.leases import Lease, claim
from tests.netfake.certs import make_certs

__all__ = ["WEB_NAMES", "FakeEvent", "FakeInternet", "FakeInternetError", "free_net_pool"]

REPO = Path(__file__).resolve().parents[2]
_LOCK = Path("/run/lock/hutch-netfake.lock")
_NS_RE = re.compile(r"^hfn-(\d+)-[0-9a-f]+$")
START_TIMEOUT_S = 20.0
# The pools free_net_pool handed out, claimed while this process lives.
_pools: list[Lease] = []

#: Names served by the web servers on the shared address (``.10``) and their host octet.
WEB_NAMES = {
    "good.test": 10,
    "www.good.test": 10,
    "other.test": 10,
    "doh.test": 10,
    "cdn2.test": 20,
}


class FakeInternetError(RuntimeError):
    """Building or running the fake internet failed; the message says which step."""


@dataclass(frozen=True)
class FakeEvent:
    """One thing that reached a fake server. ``kind``: ``dns`` (authoritative server),
    ``rogue-dns``, ``http``, ``https``, ``doh``, ``tcp`` (banner ports), ``tcp-echo``
    (line echo), ``udp`` (echo), ``tls-error``. ``fields``: what the server saw
    (qname/qtype, host/sni/local/peer...)."""

    kind: str
    time: float
    fields: dict[str, Any]

    def get(self, key: str) -> Any:
        return self.fields.get(key)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise FakeInternetError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def _delete(argv: tuple[str, ...]) -> None:
    """Run a removal; "already gone" is fine (the netns takes its veth end with it)."""
    proc = _run(*argv, check=False)
    if proc.returncode != 0 and "Cannot find" not in proc.stderr and "No such" not in proc.stderr:
        raise FakeInternetError(f"{' '.join(argv)}: {proc.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_namespaces() -> list[str]:
    """Delete fake-internet namespaces whose creating process is gone; returns them."""
    reaped = []
    for line in _run("ip", "netns", "list").stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NS_RE.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _kill_ns_processes(name)
            _run("ip", "netns", "del", name, check=False)
            reaped.append(name)
    return reaped


def _kill_ns_processes(ns: str) -> None:
    pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _used_third_octets() -> set[int]:
    """Third octets of 198.18.x.0/24 already on this host (addresses or routes)."""
    text = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
    return {int(m) for m in re.findall(r"\b198\.18\.(\d+)\.\d+", text)}


def free_net_pool() -> str:
    """A ``HUTCH_NET_POOL`` for a daemon under test: a /24 of 10.199.0.0/16 that no
    address or route on this host uses. 10.199/16 is neither hutch's default pool
    (10.213.0.0/16) nor the e2e daemons' (10.200.0.0/13), so a network test's sandboxes
    never share addresses with another daemon's."""
    text = _run("ip", "-4", "addr").stdout + _run("ip", "-4", "route").stdout
    used = {int(m) for m in re.findall(r"\b10\.199\.(\d+)\.", text)}
    free = [n for n in range(1, 255) if n not in used]
    # Not in use is not enough: a daemon takes its first address only when it creates a
    # sandbox, so a pool is claimed (tests/leases.py) until this process exits, and
    # another run on this machine (`make test`'s other lane) picks a different one.
    start = secrets.randbelow(len(free)) if free else 0
    lease = claim("net-pool", (f"10.199.{n}.0" for n in free[start:] + free[:start]))
    if lease is None:
        raise FakeInternetError("no free 10.199.x.0/24 left for a test address pool")
    _pools.append(lease)
    return f"{lease.name}/24"


class FakeInternet:
    """Context manager: ``with FakeInternet() as net: ...``.

    ``work_dir``: where certificates, the spec and the event log go (default: a fresh
    temp dir, removed on exit). ``python``: the interpreter that runs the servers (needs
    dnspython). Attributes after ``__enter__``: ``ns``, ``host_if``, ``prefix``,
    ``gateway`` (host side), ``web``/``cdn``/``dns``/``rogue`` (IPv4 strings), ``web6``,
    ``ca_cert``, ``names`` (name -> IPv4 of the web names).
    """

    def __init__(self, work_dir: Path | None = None, python: str = sys.executable) -> None:
        self._own_dir = work_dir is None
        self.work_dir = Path(work_dir or tempfile.mkdtemp(prefix="hutch-netfake-"))
        self.python = python
        rand = secrets.token_hex(3)
        self.ns = f"hfn-{os.getpid()}-{rand}"
        self.host_if = f"fnh-{rand}"
        self.ns_if = f"fnn-{rand}"
        self.octet = -1
        self._proc: subprocess.Popen[bytes] | None = None
        self._undo: list[Callable[[], None]] = []
        self.events_path = self.work_dir / "events.jsonl"

    # -- addresses -------------------------------------------------------------------------

    def _v4(self, host: int) -> str:
        return f"198.18.{self.octet}.{host}"

    @property
    def prefix(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"198.18.{self.octet}.0/24")

    @property
    def prefix6(self) -> ipaddress.IPv6Network:
        return ipaddress.IPv6Network(f"2001:2:0:{self.octet:x}::/64")

    @property
    def gateway(self) -> str:
        """The host's own address on the veth (a *host* address for hutch)."""
        return self._v4(1)

    @property
    def web(self) -> str:
        """The shared address of good.test, www.good.test, other.test and doh.test."""
        return self._v4(10)

    @property
    def cdn(self) -> str:
        """cdn2.test's address (a second web address)."""
        return self._v4(20)

    @property
    def dns(self) -> str:
        """The authoritative DNS server (give hutch ``HUTCH_DNS_UPSTREAM=<this>``)."""
        return self._v4(53)

    @property
    def rogue(self) -> str:
        """A resolver that answers anything (a bypass target)."""
        return self._v4(99)

    @property
    def private(self) -> str:
        """A private (RFC 1918) address served in the netns: the "LAN" a sandbox must not
        reach through a name rule. The host routes just this /32 to the netns."""
        return f"10.254.{self.octet}.3"

    @property
    def late_host(self) -> str:
        """An address configured nowhere by this class: a test puts it on a host
        interface to play an address that appears after the daemon started."""
        return f"198.19.{self.octet}.77"

    @property
    def web6(self) -> str:
        return str(self.prefix6[0x10])

    @property
    def names(self) -> dict[str, str]:
        return {name: self._v4(host) for name, host in WEB_NAMES.items()}

    @property
    def ca_cert(self) -> Path:
        return self.work_dir / "certs" / "ca.pem"

    def env(self) -> dict[str, str]:
        """What a daemon under test needs to use this internet."""
        return {"HUTCH_DNS_UPSTREAM": self.dns}

    def zone(self) -> dict[str, Any]:
        """The DNS data served (names lower-case, no trailing dot): ``a``, ``aaaa``,
        ``txt`` (name -> values) and ``cname`` (name -> target name)."""
        a = {name: [addr] for name, addr in self.names.items()}
        # Names resolving into forbidden ranges, for DNS-rebinding checks.
        a["rebind.test"] = ["127.0.0.1"]
        a["private.test"] = ["10.1.2.3"]
        a["meta.test"] = ["169.254.169.254"]
        # Names under good.test (a rule such as "*.good.test" allows them) resolving into
        # every range a name must not open (issue 16): answered without those addresses.
        k = self.octet
        a["lan.good.test"] = [self.private]
        a["lan172.good.test"] = [f"172.31.{k}.3"]
        a["lan192.good.test"] = [f"192.168.{k}.3"]
        a["cgnat.good.test"] = [f"100.64.{k}.3"]
        a["class-e.good.test"] = [f"240.0.{k}.3"]
        a["loop.good.test"] = ["127.0.0.1"]
        a["mixed.good.test"] = [self.private, self.web]
        a["late.good.test"] = [self.late_host]
        return {
            "a": a,
            "cname": {"alias.good.test": "lan.good.test"},
            "aaaa": {"good.test": [self.web6], "v6only.test": [self.web6]},
            "txt": {"good.test": ["fakenet good"], "info.test": ["fakenet info"]},
        }

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> FakeInternet:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        if os.geteuid() != 0:
            raise FakeInternetError("the fake internet needs root (ip netns, veth)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        _LOCK.parent.mkdir(parents=True, exist_ok=True)
        with _LOCK.open("w") as lock:
            # Picking the /24 and claiming it (by adding the address) is one critical
            # section across processes, so two runs never take the same prefix.
            fcntl.flock(lock, fcntl.LOCK_EX)
            reap_stale_namespaces()
            used = _used_third_octets()
            free = [k for k in range(2, 255) if k not in used]
            if not free:
                raise FakeInternetError("no free 198.18.x.0/24 left on this host")
            self.octet = free[secrets.randbelow(len(free))]
            self._build_namespace()
        self._start_servers()

    def _build_namespace(self) -> None:
        ns, h, n = self.ns, self.host_if, self.ns_if
        _run("ip", "netns", "add", ns)
        self._undo.append(lambda: _delete(("ip", "netns", "del", ns)))
        self._undo.append(lambda: _kill_ns_processes(ns))
        _run("ip", "link", "add", h, "type", "veth", "peer", "name", n)
        self._undo.append(lambda: _delete(("ip", "link", "del", h)))
        _run("ip", "link", "set", n, "netns", ns)
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", h)
        _run("ip", "-6", "addr", "add", f"{self.prefix6[1]}/64", "dev", h, "nodad")
        _run("ip", "link", "set", h, "up")
        inside = ("ip", "netns", "exec", ns)
        _run(*inside, "ip", "link", "set", "lo", "up")
        for host in (2, 10, 20, 53, 99):
            _run(*inside, "ip", "addr", "add", f"{self._v4(host)}/24", "dev", n)
        for host in (2, 0x10, 0x20):
            _run(*inside, "ip", "-6", "addr", "add", f"{self.prefix6[host]}/64", "dev", n, "nodad")
        _run(*inside, "ip", "addr", "add", f"{self.private}/32", "dev", n)
        _run(*inside, "ip", "link", "set", n, "up")
        # Only this /32 of 10/8 leads here (it goes with the veth when that is deleted).
        _run("ip", "route", "add", f"{self.private}/32", "via", self._v4(2), "dev", h)

    def _start_servers(self) -> None:
        certs = make_certs(self.work_dir / "certs", list(WEB_NAMES))
        ready = self.work_dir / "ready"
        ready.unlink(missing_ok=True)
        spec = {
            "events": str(self.events_path),
            "ready": str(ready),
            "cert": str(certs.server_cert),
            "key": str(certs.server_key),
            "dns": self.dns,
            "rogue": self.rogue,
            "rogue_answer": self.web,
            "udp_echo": [self.web, self.cdn, self.web6, self.private],
            "zone": self.zone(),
        }
        spec_path = self.work_dir / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        self.events_path.touch()
        log = (self.work_dir / "servers.log").open("wb")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._proc = subprocess.Popen(
            ["ip", "netns", "exec", self.ns, self.python, "-m", "tests.netfake.servers",
             str(spec_path)],
            cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
        log.close()
        self._undo.append(self._stop_servers)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise FakeInternetError(
                    f"fake internet servers did not start (exit {self._proc.poll()}): "
                    + (self.work_dir / "servers.log").read_text(errors="replace")[-3000:]
                )
            time.sleep(0.05)

    def _stop_servers(self) -> None:
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def close(self) -> None:
        """Stop the servers and remove the netns and veth. Safe to call twice."""
        errors = []
        while self._undo:
            step = self._undo.pop()
            try:
                step()
            except Exception as exc:  # keep undoing the rest; report at the end
                errors.append(repr(exc))
        if self._own_dir:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        if errors:
            raise FakeInternetError("cleaning up the fake internet: " + "; ".join(errors))

    # -- what happened -----------------------------------------------------------------------

    def events(self, kind: str | None = None, since: float = 0.0) -> list[FakeEvent]:
        """Everything the servers recorded (optionally of one ``kind``, after ``since``,
        a ``time.time()`` value)."""
        found = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.events_path.read_text().splitlines():
                if not line.strip():
                    continue
                raw = json.loads(line)
                event = FakeEvent(raw.pop("kind"), raw.pop("time"), raw)
                if (kind is None or event.kind == kind) and event.time >= since:
                    found.append(event)
        return found

    def dns_queries(self, since: float = 0.0) -> list[str]:
        """Names the authoritative server was asked over UDP, TCP or DoH (lower-case)."""
        return [str(e.get("qname")).lower() for e in self.events("dns", since)]

    def rogue_queries(self, since: float = 0.0) -> list[str]:
        """Names the rogue resolver was asked (lower-case)."""
        return [str(e.get("qname")).lower() for e in self.events("rogue-dns", since)]

    def exec(self, *argv: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """Run a command inside the fake internet's namespace (never raises on exit≠0)."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns, *argv],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def host_objects(self) -> Iterator[str]:
        """What of this instance still exists on the host (for leak checks)."""
        if self.ns in _run("ip", "netns", "list").stdout.split():
            yield f"netns {self.ns}"
        if _run("ip", "link", "show", self.host_if, check=False).returncode == 0:
            yield f"link {self.host_if}"
        if self.running:
            yield f"server process {self._proc.pid if self._proc else '?'}"
