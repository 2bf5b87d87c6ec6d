"""The one typed settings object: every setting with its default, and the paths under the
state directory derived from it."""

from __future__ import annotations

import hashlib
import ipaddress
import socket
from dataclasses import dataclass, field
from pathlib import Path

from hutch.config.cluster import ClusterSettings
from hutch.config.meter import MeterSettings
from hutch.config.network import DEFAULT_NET_POOL, NetLimits
from hutch.config.resources import Limits
from hutch.contract.limits import DEFAULT_IMAGE

ACCEL_CHOICES = ("auto", "kvm", "tcg")
MAX_DISK_LAYERS_RANGE = (1, 32)
#: Bytes of serial console kept per log file (console.log and console.log.1).
CONSOLE_LOG_BYTES_RANGE = (64 << 10, 1 << 30)
#: Seconds pause, snapshot and fork wait for calls in flight in the sandbox.
LIFECYCLE_WAIT_S_RANGE = (0.0, 3600.0)


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
    # --- issue 15 (speed): a fork or named snapshot of a template clone rebased on a
    # memory file of its own (hutch.vm.snapshot_rebase). Off by default: measured slower
    # than the full stream on 2 loaded cores, and its helper QEMU failed in a daemon run
    # (ARCHITECTURE.md, "Copy-on-write memory").
    fork_ram_in_file: bool = False
    # Keep address-space randomization on in guests under TCG too. Off (the default),
    # the agent turns it off there so that every process reuses the code QEMU translated
    # for the last one (spawns ~5x faster; hutch_agent.system.keep_translations_reusable).
    # Under KVM the guest's own setting is always left alone.
    guest_aslr: bool = False
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
    # Seconds a request that needs the S3 store waits, in all, for an endpoint that has
    # not answered yet (or whose last request failed to connect) before it fails with
    # blob_error naming the endpoint; once it answers, transfers are retried for a
    # minute while it is away (hutch.storage.blobs.s3).
    s3_connect_timeout_s: float = 5.0
    # Bytes the local copies of uploaded named snapshots may hold; past it the least
    # recently used ones that no sandbox uses are removed (fetched again when needed).
    # 0: no limit.
    blob_cache_bytes: int = 0
    # With a blob store: upload this host's built-in images and replace a copy unlike
    # the bucket's (hutch.services.builtin_blobs). Off where every host shares one
    # images directory (one machine, a network file system): nothing to converge; a
    # digest this host lacks is still fetched from an upload made elsewhere.
    blob_builtin_images: bool = True
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
