"""One typed settings object, read from ``HUTCH_*`` environment variables and an optional
TOML file (``HUTCH_CONFIG``, or ``<state_dir>/config.toml`` when present).

Precedence: environment > config file > defaults.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import os
import re
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from hutch.contract.limits import DEFAULT_IMAGE
from hutch.errors import InvalidArgument

ACCEL_CHOICES = ("auto", "kvm", "tcg")
DEFAULT_NET_POOL = ipaddress.IPv4Network("10.213.0.0/16")
MAX_DISK_LAYERS_RANGE = (1, 32)
_N = TypeVar("_N", int, float)
#: Bytes of serial console kept per log file (console.log and console.log.1).
CONSOLE_LOG_BYTES_RANGE = (64 << 10, 1 << 30)
#: Seconds pause, snapshot and fork wait for calls in flight in the sandbox.
LIFECYCLE_WAIT_S_RANGE = (0.0, 3600.0)
#: Per-sandbox cgroups (hutch.vm.cgroups): auto = when the host allows, on = required.
CGROUP_MODES = ("auto", "on", "off")
#: MiB of host memory a QEMU may use beyond guest RAM and the TCG translation cache.
CGROUP_MEMORY_OVERHEAD_MIB_RANGE = (16, 65536)
#: Percent of one core per vCPU a sandbox's QEMU may use (0: no quota, weights only).
CGROUP_CPU_QUOTA_PCT_RANGE = (10, 10000)
#: MiB of TCG translation cache per VM (QEMU's ``tb-size``).
TCG_TB_MIB_RANGE = (8, 2048)


@dataclass(frozen=True)
class Limits:
    """Host capacity. Creating past these fails with ``Capacity``."""

    max_sandboxes: int = 64
    # Memory all running sandboxes may reserve together, MiB. 0 means 3/4 of host RAM.
    max_memory_mib: int = 0

    @property
    def memory_budget_mib(self) -> int:
        return self.max_memory_mib or host_memory_mib() * 3 // 4


@dataclass(frozen=True)
class NetLimits:
    """Per-sandbox budgets of the data path. Every sandbox has its own: one that uses
    up its budget (a flood) changes nothing for another. Rates are per second, bursts
    how many may come at once after a quiet spell (token buckets).

    - ``dns_rate``/``dns_burst``: queries to hutch's resolver (UDP and TCP). Past it a
      query is answered REFUSED without being looked at; past twice it the kernel drops
      the packets before they reach the daemon.
    - ``proxy_conn_rate``/``proxy_conn_burst``: new connections to the SNI/Host proxy
      (rules mode, ports 80/443). Past it a connection is closed at once; past twice it
      the kernel drops the SYNs (new TCP connections to the resolver count there too).
    - ``deny_log_rate``/``deny_log_burst``: denied packets logged one by one (NFLOG).
      Past it denials are still dropped and counted, and the log says how many were
      not logged.

    The defaults are far above what a program resolving and connecting as it works
    does (a build, a package install, a crawler); they stop floods.
    """

    dns_rate: int = 200
    dns_burst: int = 400
    proxy_conn_rate: int = 100
    proxy_conn_burst: int = 200
    deny_log_rate: int = 20
    deny_log_burst: int = 40
    #: Denials (resolver and proxy decisions) in one minute that make a *denial spike*:
    #: one summary line in the sandbox's egress log and the enforcer's
    #: ``denial_spike_hook`` (the event log's ``egress.denied``), once per minute.
    deny_spike_per_min: int = 120


@dataclass(frozen=True)
class MeterSettings:
    """The meter, the event log and the price table (ARCHITECTURE.md, "Metering and
    events"). Prices are USD per unit-hour (egress: per GB); the defaults are the issue's.

    - ``heartbeat_s``: how often the meter writes that each running VM is alive; a VM
      found gone after a restart is billed to its last heartbeat, so at most this long
      of the time it ran under a live daemon goes unbilled.
    - ``events_retention_days`` / ``events_max``: the reaper drops events older than the
      one and all but the newest of the other.
    - ``egress_event_s``: a sandbox's denied egress is one ``egress.denied`` event per
      this many seconds at most (a summary: counts and the top destinations), whatever
      the packet rate. Egress bytes are written to the meter every ``heartbeat_s``.
    - ``events``: False turns the event log off (no traces, no audit trail); the meter
      is written all the same. ``bench/`` compares exec round trips with and without.
    """

    price_vcpu_hour: float = 0.03616363
    price_gib_hour: float = 0.01159025
    price_storage_gb_hour: float = 0.0001584
    price_egress_gb: float = 0.0
    heartbeat_s: float = 5.0
    egress_event_s: float = 60.0
    events_retention_days: float = 30.0
    events_max: int = 1_000_000
    events: bool = True


#: setting -> (bounds, what it is), for the messages of bad values.
METER_SETTINGS: dict[str, tuple[tuple[float, float], str]] = {
    "price_vcpu_hour": ((0.0, 1e6), "USD per vCPU-hour"),
    "price_gib_hour": ((0.0, 1e6), "USD per GiB-hour of memory"),
    "price_storage_gb_hour": ((0.0, 1e6), "USD per GB-hour of storage"),
    "price_egress_gb": ((0.0, 1e6), "USD per GB of egress"),
    "heartbeat_s": ((1.0, 60.0), "seconds between a running VM's meter heartbeats"),
    "egress_event_s": ((1.0, 3600.0), "seconds a sandbox's egress.denied event sums up"),
    "events_retention_days": ((0.01, 36500.0), "days events are kept"),
    "events_max": ((1000.0, 1e9), "events kept at most"),
}


#: setting -> (accepted range, what it counts): the validation messages say both.
NET_LIMIT_SETTINGS: dict[str, tuple[tuple[int, int], str]] = {
    "dns_rate": ((1, 100_000), "DNS queries per second per sandbox"),
    "dns_burst": ((1, 1_000_000), "DNS queries at once per sandbox"),
    "proxy_conn_rate": ((1, 100_000), "new proxy connections per second per sandbox"),
    "proxy_conn_burst": ((1, 1_000_000), "new proxy connections at once per sandbox"),
    "deny_log_rate": ((1, 100_000), "denied packets logged per second per sandbox"),
    "deny_log_burst": ((1, 1_000_000), "denied packets logged at once per sandbox"),
    "deny_spike_per_min": ((1, 1_000_000), "denials per minute per sandbox that raise an alert"),
}


#: The roles a hutchd runs in: ``single`` (one host, the default) or ``worker`` (one of
#: several hutchds sharing one database; ARCHITECTURE.md, "Many hosts").
HOST_ROLES = ("single", "worker")
#: Seconds a host's lease lasts without a renewal before another host marks it down.
HOST_LEASE_S_RANGE = (2.0, 3600.0)


@dataclass(frozen=True)
class ClusterSettings:
    """This hutchd as a host of a cluster (``hutch.services.cluster``).

    - ``role``: ``single`` or ``worker``. A single host registers itself too (so
      ``hutch host ls`` works on one machine), as host ``local``.
    - ``host_id``: the host's id in the ``hosts`` table; a worker's default is
      ``<hostname>-<daemon tag>``. Two hutchds on one database must not share it.
    - ``address``: the URL the other hutchds reach this one's API at (default: its
      listen address); where sandboxes' egress cannot go (the host's own addresses).
    - ``labels``: ``key=value`` pairs that creates pin to (``placement.labels``).
    - ``lease_s``: a lease not renewed for this long marks the host down; renewed every
      third of it.
    - ``secret_path``: the cluster secret that signs host-to-host calls; every host of a
      cluster holds the same file (0600). Created on first start when missing.
    - ``shared_db``: one SQLite file shared by the hutchds of one machine (WAL), until
      the PostgreSQL store takes ``HUTCH_DATABASE_URL``; None: ``<state>/hutch.db``.
    """

    role: str = "single"
    host_id: str = ""
    address: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    lease_s: float = 15.0
    secret_path: Path | None = None
    shared_db: Path | None = None
    # -- the overlay between hosts (hutch.net.tunnel; private networks across hosts) --
    #: UDP port of this host's VXLAN end (``HUTCH_TUNNEL_PORT``, e.g. 4789); None or 0
    #: = off (the default until the data path is proven: ARCHITECTURE.md, "Private
    #: networks across hosts").
    tunnel_port: int | None = None
    #: Underlay IPv4 address of this host's end (``HUTCH_TUNNEL_ADDRESS``); "" = the
    #: host of ``address`` (resolved at start).
    tunnel_address: str = ""

    @property
    def worker(self) -> bool:
        return self.role == "worker"

    @property
    def tunnel_udp_port(self) -> int:
        """The tunnel's UDP port; 0 = no tunnel."""
        return self.tunnel_port or 0


def parse_labels(value: str, name: str = "HUTCH_HOST_LABELS") -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` -> sorted pairs; InvalidArgument names a bad pair."""
    pairs: dict[str, str] = {}
    for item in (p.strip() for p in value.split(",")):
        if not item:
            continue
        key, sep, val = item.partition("=")
        if not sep or not _LABEL_RE.match(key) or not _LABEL_RE.match(val):
            raise InvalidArgument(
                f"{name}: {item!r} is not key=value (letters, digits, '.', '_', '-', "
                "'/'; 1-63 characters each)"
            )
        pairs[key] = val
    return tuple(sorted(pairs.items()))


_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


def host_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


@dataclass(frozen=True)
class Settings:
    state_dir: Path = Path("./var")
    listen_host: str = "127.0.0.1"
    listen_port: int = 7070
    accel: str = "auto"
    default_image: str = DEFAULT_IMAGE
    limits: Limits = field(default_factory=Limits)
    # Seconds to wait for a booting guest's agent before giving up.
    boot_timeout_s: float = 120.0
    # Built images may be shared by several state directories (tests do this).
    images_dir_override: Path | None = None
    # Create by restoring a template snapshot per (image, shape) instead of booting.
    templates: bool = True
    # A template keeps guest RAM in its memory.ram, which clones map copy-on-write (a
    # state-only stream); off: all RAM in the stream, each clone loads its own copy.
    template_ram_in_file: bool = True
    # Sandboxes per image kept restored ahead of time (default shape only); 0 = no pool.
    pool_size: int = 0
    # Sandbox addresses: each sandbox takes a /30 of this IPv4 pool (gateway .1, guest .2).
    net_pool: ipaddress.IPv4Network = DEFAULT_NET_POOL
    # Where hutch's resolver forwards names a sandbox may resolve; None: the host's
    # resolvers from /etc/resolv.conf.
    dns_upstream: tuple[str, int] | None = None
    # PEM file of the CAs that upstream servers are verified against when hutch's proxy
    # terminates TLS (egress inspection "full"); None: the host's trust store.
    egress_upstream_ca: Path | None = None
    # Host address that exposed sandbox ports listen on.
    ports_bind: str = "127.0.0.1"
    # qcow2 layers a sandbox disk may sit on before it is compacted (forks and named
    # snapshots add one each).
    max_disk_layers: int = 8
    # The unprivileged user QEMU runs as once set up (a daemon running as root only);
    # "root": QEMU keeps root (not advised: a QEMU escape would own the host).
    qemu_user: str = "hutch-qemu"
    # Serial console kept per sandbox: console.log rotates into console.log.1 at this
    # size, so at most twice this is on disk (hutch.vm.console).
    console_log_bytes: int = 1 << 20
    # How long pause, snapshot and fork wait for execs, file transfers and code runs in
    # flight in the sandbox before they give up with 409 busy (naming what still runs).
    lifecycle_wait_s: float = 30.0
    # Per-sandbox rate limits of the resolver, the proxy and the denial log.
    net_limits: NetLimits = field(default_factory=NetLimits)
    # Bytes an imported image may hold: the archive uploaded and the files its layers
    # write, each (a decompression bomb would otherwise fill the disk).
    max_image_bytes: int = 32 << 30
    # Each QEMU in a cgroup of its own with CPU, memory, I/O and pids limits: "auto" when
    # the host allows it (root, a cgroup hutchd may manage), "on" refuses to start
    # without, "off" never (ARCHITECTURE.md, "Resource limits").
    cgroups: str = "auto"
    # Host memory a QEMU may use beyond guest RAM (+ the TCG cache) before the kernel
    # kills it and the sandbox fails with "out of memory".
    cgroup_memory_overhead_mib: int = 64
    # CPU quota per vCPU, percent of one core; 0 = no quota (CPU weights only).
    cgroup_cpu_quota_pct: int = 100
    # TCG's translation cache per VM, MiB (QEMU's default is 1 GiB, filled by a busy
    # guest: host memory that is not guest RAM).
    tcg_tb_mib: int = 64
    # Bytes the Dockerfile build cache (step layers under <state>/build-cache) may hold on
    # disk; past it the least recently used layers go after a build.
    build_cache_bytes: int = 20 << 30
    # Where the E2B-compatible API listens (E2B_API_URL and E2B_SANDBOX_URL point
    # here); None: not served.
    e2b_listen: tuple[str, int] | None = None
    # The meter, the event log's retention and the price table.
    meter: MeterSettings = field(default_factory=MeterSettings)
    # This hutchd as a host of a cluster (role, id, address, labels, lease).
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    # Where named snapshots are kept besides this host (hutch.storage.blobs): None keeps
    # them on this host only (their directory under snapshots/ is the copy);
    # file:///path or s3://bucket/prefix mirrors each one there once it is saved.
    blob_url: str | None = None
    # The S3 endpoint (MinIO, R2, SeaweedFS, ...); None: AWS. Credentials and region:
    # AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION (boto3's chain).
    s3_endpoint: str | None = None
    # Bytes the local copies of uploaded named snapshots may hold; past it the least
    # recently used ones that no sandbox uses are removed (fetched again when needed).
    # 0: no limit.
    blob_cache_bytes: int = 0
    # The database of the state: None = SQLite in <state_dir>/hutch.db (one host);
    # a postgresql:// URL (parse_database_url) = that PostgreSQL database.
    database_url: str | None = None

    @property
    def db_path(self) -> Path:
        return self.cluster.shared_db or self.state_dir / "hutch.db"

    @property
    def host_id(self) -> str:
        """This hutchd's id in the ``hosts`` table (see :class:`ClusterSettings`)."""
        if self.cluster.host_id:
            return self.cluster.host_id
        if not self.cluster.worker:
            return "local"
        return f"{socket.gethostname()}-{self.daemon_tag}"

    @property
    def host_address(self) -> str:
        """The URL the other hutchds reach this one at."""
        return self.cluster.address or f"http://{self.listen}"

    @property
    def cluster_secret_path(self) -> Path:
        return self.cluster.secret_path or self.state_dir / "cluster-secret"

    @property
    def database(self) -> Path | str:
        """What ``hutch.store.Store`` opens: the SQLite file, or the PostgreSQL URL."""
        return self.database_url if self.database_url is not None else self.db_path

    @property
    def api_key_path(self) -> Path:
        return self.state_dir / "api-key"

    @property
    def secrets_key_path(self) -> Path:
        """The AES-256-GCM key sealing the secrets (0600, outside the database)."""
        return self.state_dir / "secrets.key"

    @property
    def egress_ca_dir(self) -> Path:
        """The egress proxy's CA (``ca.pem``, ``ca.key`` 0600): TLS inspection "full"."""
        return self.state_dir / "egress-ca"

    @property
    def images_dir(self) -> Path:
        return self.images_dir_override or self.state_dir / "images"

    @property
    def build_cache_dir(self) -> Path:
        return self.state_dir / "build-cache"

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def run_dir(self) -> Path:
        """Short directory for unix sockets (their paths are limited to 107 bytes).

        Derived from the state directory so two daemons never share it and a restarted
        daemon finds its sockets again.
        """
        digest = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:10]
        return Path("/run/hutch") / digest

    @property
    def daemon_tag(self) -> str:
        """4 hex digits naming this daemon's host network objects (taps, nft table)."""
        return hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:4]

    @property
    def listen(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    @property
    def metrics_token_path(self) -> Path:
        """The Prometheus scrape token (``GET /metrics``), 0600, created on first start."""
        return self.state_dir / "metrics-token"

    @property
    def e2b_key_path(self) -> Path:
        """The admin key in E2B's form (``E2B_API_KEY``), 0600."""
        return self.state_dir / "e2b-api-key"

    @property
    def e2b_secret_path(self) -> Path:
        """The secret the E2B face derives sandbox access tokens from, 0600."""
        return self.state_dir / "e2b-token-secret"


def parse_listen(value: str, name: str = "HUTCH_LISTEN") -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` for IPv6)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{name}={value!r} is not host:port (example: 127.0.0.1:7070)")
    return host.strip("[]"), int(port)


DATABASE_URL_FORMS = (
    "postgresql://USER[:PASSWORD]@HOST[:PORT]/DBNAME, "
    "postgresql://USER@/DBNAME?host=/SOCKET/DIR (a unix socket directory), "
    "or unset for SQLite in the state directory"
)


def parse_database_url(value: str, name: str = "HUTCH_DATABASE_URL") -> str | None:
    """A PostgreSQL URL as libpq takes it (``postgres://`` too), or None for "" (SQLite).
    Checked here for its shape only; the server is asked when the store opens."""
    raw = value.strip()
    if not raw:
        return None
    shown = _redacted(raw)
    try:
        parts = urlsplit(raw)
        port = parts.port
    except ValueError as exc:
        raise InvalidArgument(f"{name}={shown!r} is not a URL ({exc}); accepted: "
                              f"{DATABASE_URL_FORMS}") from exc  # fmt: skip
    if parts.scheme not in ("postgresql", "postgres"):
        raise InvalidArgument(
            f"{name}={shown!r}: the scheme must be postgresql:// (the only database besides "
            f"the default SQLite); accepted: {DATABASE_URL_FORMS}"
        )
    query = parse_qs(parts.query)
    if not parts.hostname and not query.get("host"):
        raise InvalidArgument(
            f"{name}={shown!r} names no server: give a host (and port) or ?host=<socket "
            f"directory>; accepted: {DATABASE_URL_FORMS}"
        )
    if not parts.path.strip("/") and not query.get("dbname"):
        raise InvalidArgument(
            f"{name}={shown!r} names no database (the path after the host); accepted: "
            f"{DATABASE_URL_FORMS}"
        )
    if port is not None and not 1 <= port <= 65535:
        raise InvalidArgument(f"{name}={shown!r}: port {port} is out of 1-65535")
    return raw


def _redacted(url: str) -> str:
    """``url`` with any password replaced by ``***`` (it goes into error messages)."""
    return re.sub(r"(://[^:/@?#]*:)[^@/?#]*@", r"\1***@", url)


def parse_dns_upstream(value: str) -> tuple[str, int]:
    """Parse ``ip[:port]`` (``[v6]:port`` for IPv6 with a port); the port defaults to 53."""
    text = value.strip()
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise InvalidArgument(f"HUTCH_DNS_UPSTREAM={value!r} is not [ipv6]:port")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        if not port_text.isdigit():
            raise InvalidArgument(f"HUTCH_DNS_UPSTREAM={value!r}: port is not a number")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError as exc:
        raise InvalidArgument(
            f"HUTCH_DNS_UPSTREAM={value!r}: {host!r} is not an IP address; "
            "accepted: ip[:port], e.g. 192.0.2.53 or 192.0.2.53:5353"
        ) from exc
    if not 0 < port < 65536:
        raise InvalidArgument(f"HUTCH_DNS_UPSTREAM={value!r}: port {port} is out of 1-65535")
    return host, port


def parse_net_pool(value: str) -> ipaddress.IPv4Network:
    """Parse the sandbox address pool: an IPv4 CIDR of /8 to /28."""
    try:
        pool = ipaddress.IPv4Network(value.strip(), strict=True)
    except ValueError as exc:
        raise InvalidArgument(
            f"HUTCH_NET_POOL={value!r} is not an IPv4 network (example: 10.213.0.0/16): {exc}"
        ) from exc
    if not 8 <= pool.prefixlen <= 28:
        raise InvalidArgument(f"HUTCH_NET_POOL={value!r}: prefix length must be 8-28")
    return pool


def _number(values: dict[str, Any], key: str, kind: type[_N], source: str) -> _N:
    try:
        return kind(values[key])
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{source}: {key}={values[key]!r} is not a number") from exc


def _net_limit(source: str, key: str, value: Any) -> int:
    (lo, hi), what = NET_LIMIT_SETTINGS[key]
    env = _ENV_OF.get(key, key)
    shown = env if source == "environment" else f"{source}: {key}"
    text = str(value).strip()
    if isinstance(value, bool) or not text.isdigit() or not lo <= int(text) <= hi:
        raise InvalidArgument(f"{shown}={value!r} is not valid; accepted: {lo}-{hi} ({what})")
    return int(text)


def _from_mapping(base: Settings, values: dict[str, Any], source: str) -> Settings:
    known = {f.name for f in fields(Settings)} - {
        "images_dir_override", "limits", "net_limits", "meter", "cluster",
    }  # fmt: skip
    known = known - {"e2b_listen"} | {
        "listen", "e2b_listen", "max_sandboxes", "max_memory_mib", "images_dir",
        *NET_LIMIT_SETTINGS, *METER_SETTINGS, "events", *CLUSTER_KEYS,
    }  # fmt: skip
    unknown = set(values) - known
    if unknown:
        raise InvalidArgument(
            f"{source}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}"
        )
    s = base
    try:
        if "state_dir" in values:
            s = replace(s, state_dir=Path(str(values["state_dir"])))
        if "listen" in values:
            host, port = parse_listen(str(values["listen"]))
            s = replace(s, listen_host=host, listen_port=port)
        if "e2b_listen" in values:
            raw = str(values["e2b_listen"]).strip()
            e2b = None if raw in ("", "off") else parse_listen(raw, "HUTCH_E2B_LISTEN")
            s = replace(s, e2b_listen=e2b)
        if "database_url" in values:
            shown = "HUTCH_DATABASE_URL" if source == "environment" else f"{source}: database_url"
            url = parse_database_url(str(values["database_url"]), shown)
            s = replace(s, database_url=url)
        if "accel" in values:
            s = replace(s, accel=str(values["accel"]).lower())
        if "default_image" in values:
            s = replace(s, default_image=str(values["default_image"]))
        if "images_dir" in values:
            s = replace(s, images_dir_override=Path(str(values["images_dir"])).resolve())
        if "templates" in values:
            flag = str(values["templates"]).lower()
            if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise InvalidArgument(f"{source}: templates={flag!r}; accepted: 1/0, true/false")
            s = replace(s, templates=flag in ("1", "true", "yes", "on"))
        if "template_ram_in_file" in values:
            flag = str(values["template_ram_in_file"]).lower()
            if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise InvalidArgument(
                    f"{source}: template_ram_in_file={flag!r}; accepted: 1/0, true/false"
                )
            s = replace(s, template_ram_in_file=flag in ("1", "true", "yes", "on"))
        if "pool_size" in values:
            s = replace(s, pool_size=int(values["pool_size"]))
            if not 0 <= s.pool_size <= 32:
                raise InvalidArgument(f"{source}: pool_size={s.pool_size}; accepted: 0-32")
        if "net_pool" in values:
            s = replace(s, net_pool=parse_net_pool(str(values["net_pool"])))
        if "dns_upstream" in values:
            s = replace(s, dns_upstream=parse_dns_upstream(str(values["dns_upstream"])))
        if "egress_upstream_ca" in values:
            raw_ca = str(values["egress_upstream_ca"]).strip()
            ca_path = Path(raw_ca).resolve() if raw_ca else None
            if ca_path is not None and not ca_path.is_file():
                raise InvalidArgument(
                    f"{source}: egress_upstream_ca={raw_ca!r} is not a file; accepted: a PEM "
                    "file of CA certificates (empty: the host's trust store)"
                )
            s = replace(s, egress_upstream_ca=ca_path)
        if "ports_bind" in values:
            bind = str(values["ports_bind"])
            try:
                ipaddress.ip_address(bind)
            except ValueError as exc:
                raise InvalidArgument(
                    f"{source}: ports_bind={bind!r} is not an IP address"
                ) from exc
            s = replace(s, ports_bind=bind)
        if "max_disk_layers" in values:
            s = replace(s, max_disk_layers=int(values["max_disk_layers"]))
            lo, hi = MAX_DISK_LAYERS_RANGE
            if not lo <= s.max_disk_layers <= hi:
                raise InvalidArgument(
                    f"{source}: max_disk_layers={s.max_disk_layers}; accepted: {lo}-{hi}"
                )
        if "qemu_user" in values:
            s = replace(s, qemu_user=str(values["qemu_user"]))
        if "max_image_bytes" in values:
            s = replace(s, max_image_bytes=_number(values, "max_image_bytes", int, source))
            if s.max_image_bytes < 1 << 20:
                raise InvalidArgument(f"{source}: max_image_bytes must be at least 1 MiB")
        if "build_cache_bytes" in values:
            s = replace(s, build_cache_bytes=_number(values, "build_cache_bytes", int, source))
            if s.build_cache_bytes < 0:
                raise InvalidArgument(f"{source}: build_cache_bytes must be 0 or more")
        if "boot_timeout_s" in values:
            s = replace(s, boot_timeout_s=float(values["boot_timeout_s"]))
        if "console_log_bytes" in values:
            s = replace(s, console_log_bytes=_number(values, "console_log_bytes", int, source))
            lo, hi = CONSOLE_LOG_BYTES_RANGE
            if not lo <= s.console_log_bytes <= hi:
                raise InvalidArgument(
                    f"{source}: console_log_bytes={s.console_log_bytes}; accepted: {lo}-{hi}"
                )
        if "lifecycle_wait_s" in values:
            s = replace(s, lifecycle_wait_s=_number(values, "lifecycle_wait_s", float, source))
            lo_s, hi_s = LIFECYCLE_WAIT_S_RANGE
            if not lo_s <= s.lifecycle_wait_s <= hi_s:
                raise InvalidArgument(
                    f"{source}: lifecycle_wait_s={s.lifecycle_wait_s:g}; accepted: "
                    f"{lo_s:g}-{hi_s:g} seconds"
                )
        s = _cgroup_settings(s, values, source)
        s = _cluster_settings(s, values, source)
        s = _blob_settings(s, values, source)
        limits = s.limits
        if "max_sandboxes" in values:
            limits = replace(limits, max_sandboxes=int(values["max_sandboxes"]))
        if "max_memory_mib" in values:
            limits = replace(limits, max_memory_mib=int(values["max_memory_mib"]))
        s = replace(s, limits=limits)
        net_limits = {
            k: _net_limit(source, k, values[k]) for k in NET_LIMIT_SETTINGS if k in values
        }
        if net_limits:
            s = replace(s, net_limits=replace(s.net_limits, **net_limits))
        meter: dict[str, Any] = {
            k: _meter_setting(source, k, values[k]) for k in METER_SETTINGS if k in values
        }
        if "events" in values:
            flag = str(values["events"]).strip().lower()
            if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                shown = "HUTCH_EVENTS" if source == "environment" else f"{source}: events"
                raise InvalidArgument(f"{shown}={values['events']!r}; accepted: on/off, 1/0")
            meter["events"] = flag in ("1", "true", "yes", "on")
        if meter:
            s = replace(s, meter=replace(s.meter, **meter))
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{source}: {exc}") from exc
    if s.e2b_listen is not None and s.e2b_listen[1] == s.listen_port:
        raise InvalidArgument(
            f"{source}: e2b_listen port {s.e2b_listen[1]} is the API's own port; give the "
            "E2B-compatible API a port of its own"
        )
    if s.accel not in ACCEL_CHOICES:
        raise InvalidArgument(f"{source}: accel={s.accel!r}; accepted: {', '.join(ACCEL_CHOICES)}")
    return s


#: An S3 bucket name (the rules AWS, MinIO and R2 share).
S3_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: What HUTCH_BLOB_URL may be (hutch.storage.blobs.open_blob_store reads it).
ACCEPTED_BLOB_URLS = "unset (<state_dir>/blobs), file:///absolute/path, s3://bucket[/prefix]"


def check_blob_url(url: str) -> str:
    """``url`` if the blob store accepts it, else ``InvalidArgument`` naming what is
    accepted (checked when the settings are read, before anything starts)."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise InvalidArgument(
                f"HUTCH_BLOB_URL={url!r}: a file URL names an absolute path "
                f"(file:///var/lib/hutch-blobs); accepted: {ACCEPTED_BLOB_URLS}"
            )
        return url
    if parts.scheme == "s3":
        if not parts.netloc or parts.query or parts.fragment:
            raise InvalidArgument(
                f"HUTCH_BLOB_URL={url!r}: an s3 URL is s3://bucket[/prefix] (the endpoint "
                f"goes in HUTCH_S3_ENDPOINT); accepted: {ACCEPTED_BLOB_URLS}"
            )
        if not S3_BUCKET_RE.match(parts.netloc):
            raise InvalidArgument(
                f"HUTCH_BLOB_URL={url!r}: bucket name {parts.netloc!r} is not valid; "
                "accepted: 3-63 characters of lower-case letters, digits, '.' and '-', "
                "starting and ending with a letter or digit"
            )
        return url
    raise InvalidArgument(
        f"HUTCH_BLOB_URL={url!r} is not supported; accepted: {ACCEPTED_BLOB_URLS}"
    )


def _blob_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    if "blob_url" in values:
        raw = str(values["blob_url"]).strip()
        s = replace(s, blob_url=check_blob_url(raw) if raw else None)
    if "s3_endpoint" in values:
        raw = str(values["s3_endpoint"]).strip()
        if raw and not raw.startswith(("http://", "https://")):
            shown = "HUTCH_S3_ENDPOINT" if source == "environment" else f"{source}: s3_endpoint"
            raise InvalidArgument(
                f"{shown}={raw!r} is not valid; accepted: an http:// or https:// URL "
                "(https://<account>.r2.cloudflarestorage.com, http://127.0.0.1:9000)"
            )
        s = replace(s, s3_endpoint=raw or None)
    if "blob_cache_bytes" in values:
        s = replace(s, blob_cache_bytes=_number(values, "blob_cache_bytes", int, source))
        if s.blob_cache_bytes < 0:
            raise InvalidArgument(f"{source}: blob_cache_bytes must be 0 (no limit) or more")
    return s


def _meter_setting(source: str, key: str, value: Any) -> float | int:
    (lo, hi), what = METER_SETTINGS[key]
    env = _ENV_OF.get(key, key)
    shown = env if source == "environment" else f"{source}: {key}"
    try:
        number = float(str(value).strip())
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not lo <= number <= hi:
        raise InvalidArgument(f"{shown}={value!r} is not valid; accepted: {lo:g}-{hi:g} ({what})")
    return int(number) if key == "events_max" else number


def _in_range(source: str, key: str, value: Any, bounds: tuple[int, int], what: str) -> int:
    env = _ENV_OF.get(key, key)
    shown = env if source == "environment" else f"{source}: {key}"
    text = str(value).strip()
    lo, hi = bounds
    if isinstance(value, bool) or not text.isdigit() or not lo <= int(text) <= hi:
        raise InvalidArgument(f"{shown}={value!r} is not valid; accepted: {lo}-{hi} ({what})")
    return int(text)


def _cgroup_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    if "cgroups" in values:
        mode = str(values["cgroups"]).strip().lower()
        if mode not in CGROUP_MODES:
            shown = "HUTCH_CGROUPS" if source == "environment" else f"{source}: cgroups"
            raise InvalidArgument(
                f"{shown}={values['cgroups']!r} is not valid; accepted: {', '.join(CGROUP_MODES)}"
            )
        s = replace(s, cgroups=mode)
    if "cgroup_memory_overhead_mib" in values:
        s = replace(
            s,
            cgroup_memory_overhead_mib=_in_range(
                source,
                "cgroup_memory_overhead_mib",
                values["cgroup_memory_overhead_mib"],
                CGROUP_MEMORY_OVERHEAD_MIB_RANGE,
                "MiB of host memory per sandbox beyond guest RAM and the TCG cache",
            ),
        )
    if "cgroup_cpu_quota_pct" in values:
        value = values["cgroup_cpu_quota_pct"]
        s = replace(
            s,
            cgroup_cpu_quota_pct=0
            if str(value).strip() == "0"
            else _in_range(
                source,
                "cgroup_cpu_quota_pct",
                value,
                CGROUP_CPU_QUOTA_PCT_RANGE,
                "percent of one core per vCPU, or 0 for no quota",
            ),
        )
    if "tcg_tb_mib" in values:
        s = replace(
            s,
            tcg_tb_mib=_in_range(
                source,
                "tcg_tb_mib",
                values["tcg_tb_mib"],
                TCG_TB_MIB_RANGE,
                "MiB of TCG translation cache per sandbox",
            ),
        )
    return s


#: The cluster's settings (:class:`ClusterSettings`), by their config-file key.
CLUSTER_KEYS = (
    "role", "host_id", "host_address", "host_labels", "host_lease_s", "cluster_secret_file",
    "shared_db", "tunnel_port", "tunnel_address",
)  # fmt: skip


def _cluster_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    def shown(key: str) -> str:
        return _ENV_OF.get(key, key) if source == "environment" else f"{source}: {key}"

    c = s.cluster
    if "role" in values:
        role = str(values["role"]).strip().lower()
        if role not in HOST_ROLES:
            raise InvalidArgument(
                f"{shown('role')}={values['role']!r}; accepted: {', '.join(HOST_ROLES)}"
            )
        c = replace(c, role=role)
    if "host_id" in values:
        host_id = str(values["host_id"]).strip()
        if not _LABEL_RE.match(host_id) or "/" in host_id:
            raise InvalidArgument(
                f"{shown('host_id')}={host_id!r}; use 1-63 letters, digits, '.', '_', '-'"
            )
        c = replace(c, host_id=host_id)
    if "host_address" in values:
        address = str(values["host_address"]).strip().rstrip("/")
        if not re.match(r"^https?://[^/\s]+$", address):
            raise InvalidArgument(
                f"{shown('host_address')}={address!r}; use http://HOST:PORT (or https://)"
            )
        c = replace(c, address=address)
    if "host_labels" in values:
        c = replace(c, labels=parse_labels(str(values["host_labels"]), shown("host_labels")))
    if "host_lease_s" in values:
        lease = _number(values, "host_lease_s", float, source)
        lo, hi = HOST_LEASE_S_RANGE
        if not lo <= lease <= hi:
            raise InvalidArgument(f"{shown('host_lease_s')}={lease:g}; accepted: {lo:g}-{hi:g} s")
        c = replace(c, lease_s=lease)
    if "cluster_secret_file" in values:
        c = replace(c, secret_path=Path(str(values["cluster_secret_file"])).resolve())
    if "shared_db" in values:
        c = replace(c, shared_db=Path(str(values["shared_db"])).resolve())
    # -- the overlay between hosts --
    if "tunnel_port" in values:
        port = _number(values, "tunnel_port", int, source)
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"{shown('tunnel_port')}={port}; accepted: 0 (off) or 1-65535")
        c = replace(c, tunnel_port=port)
    if "tunnel_address" in values:
        text = str(values["tunnel_address"]).strip()
        try:
            ipaddress.IPv4Address(text)
        except ValueError as exc:
            raise InvalidArgument(
                f"{shown('tunnel_address')}={text!r}; use this host's IPv4 address on the "
                "network between the hosts"
            ) from exc
        c = replace(c, tunnel_address=text)
    return replace(s, cluster=c)


_ENV = {
    "HUTCH_STATE_DIR": "state_dir",
    "HUTCH_DATABASE_URL": "database_url",
    "HUTCH_LISTEN": "listen",
    "HUTCH_ACCEL": "accel",
    "HUTCH_DEFAULT_IMAGE": "default_image",
    "HUTCH_BOOT_TIMEOUT_S": "boot_timeout_s",
    "HUTCH_IMAGES_DIR": "images_dir",
    "HUTCH_TEMPLATES": "templates",
    "HUTCH_TEMPLATE_RAM_IN_FILE": "template_ram_in_file",
    "HUTCH_POOL_SIZE": "pool_size",
    "HUTCH_MAX_SANDBOXES": "max_sandboxes",
    "HUTCH_MAX_MEMORY_MIB": "max_memory_mib",
    "HUTCH_NET_POOL": "net_pool",
    "HUTCH_DNS_UPSTREAM": "dns_upstream",
    "HUTCH_PORTS_BIND": "ports_bind",
    "HUTCH_EGRESS_UPSTREAM_CA": "egress_upstream_ca",
    "HUTCH_MAX_DISK_LAYERS": "max_disk_layers",
    "HUTCH_QEMU_USER": "qemu_user",
    "HUTCH_CONSOLE_LOG_BYTES": "console_log_bytes",
    "HUTCH_LIFECYCLE_WAIT_S": "lifecycle_wait_s",
    "HUTCH_DNS_RATE": "dns_rate",
    "HUTCH_DNS_BURST": "dns_burst",
    "HUTCH_PROXY_CONN_RATE": "proxy_conn_rate",
    "HUTCH_PROXY_CONN_BURST": "proxy_conn_burst",
    "HUTCH_DENY_LOG_RATE": "deny_log_rate",
    "HUTCH_DENY_LOG_BURST": "deny_log_burst",
    "HUTCH_DENY_SPIKE_PER_MIN": "deny_spike_per_min",
    "HUTCH_MAX_IMAGE_BYTES": "max_image_bytes",
    "HUTCH_CGROUPS": "cgroups",
    "HUTCH_CGROUP_MEMORY_OVERHEAD_MIB": "cgroup_memory_overhead_mib",
    "HUTCH_CGROUP_CPU_QUOTA_PCT": "cgroup_cpu_quota_pct",
    "HUTCH_TCG_TB_MIB": "tcg_tb_mib",
    "HUTCH_BUILD_CACHE_BYTES": "build_cache_bytes",
    "HUTCH_E2B_LISTEN": "e2b_listen",
    "HUTCH_PRICE_VCPU_HOUR": "price_vcpu_hour",
    "HUTCH_PRICE_GIB_HOUR": "price_gib_hour",
    "HUTCH_PRICE_STORAGE_GB_HOUR": "price_storage_gb_hour",
    "HUTCH_PRICE_EGRESS_GB": "price_egress_gb",
    "HUTCH_METER_HEARTBEAT_S": "heartbeat_s",
    "HUTCH_EGRESS_EVENT_S": "egress_event_s",
    "HUTCH_EVENTS_RETENTION_DAYS": "events_retention_days",
    "HUTCH_EVENTS_MAX": "events_max",
    "HUTCH_EVENTS": "events",
    "HUTCH_ROLE": "role",
    "HUTCH_HOST_ID": "host_id",
    "HUTCH_HOST_ADDRESS": "host_address",
    "HUTCH_HOST_LABELS": "host_labels",
    "HUTCH_HOST_LEASE_S": "host_lease_s",
    "HUTCH_CLUSTER_SECRET_FILE": "cluster_secret_file",
    "HUTCH_SHARED_DB": "shared_db",
    "HUTCH_TUNNEL_PORT": "tunnel_port",
    "HUTCH_TUNNEL_ADDRESS": "tunnel_address",
    "HUTCH_BLOB_URL": "blob_url",
    "HUTCH_S3_ENDPOINT": "s3_endpoint",
    "HUTCH_BLOB_CACHE_BYTES": "blob_cache_bytes",
}
_ENV_OF = {key: name for name, key in _ENV.items()}


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Build settings from the environment and the optional config file."""
    env = dict(os.environ if env is None else env)
    from_env = {key: env[name] for name, key in _ENV.items() if env.get(name)}
    settings = Settings()
    state_dir = Path(from_env.get("state_dir", str(settings.state_dir)))
    config_path = env.get("HUTCH_CONFIG") or str(state_dir / "config.toml")
    path = Path(config_path)
    if env.get("HUTCH_CONFIG") and not path.is_file():
        raise InvalidArgument(f"HUTCH_CONFIG={config_path!r}: no such file")
    if path.is_file():
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise InvalidArgument(f"{path}: not valid TOML: {exc}") from exc
        settings = _from_mapping(settings, data, str(path))
    settings = _from_mapping(settings, from_env, "environment")
    return replace(settings, state_dir=settings.state_dir.resolve())
