"""One typed settings object, read from ``HUTCH_*`` environment variables and an optional
TOML file (``HUTCH_CONFIG``, or ``<state_dir>/config.toml`` when present).

Precedence: environment > config file > defaults.

The package, by job (every name is imported from ``hutch.config`` itself):

- ``settings``: :class:`Settings`, its defaults and the paths under the state directory
- ``load``: :func:`load_settings` (environment over file over defaults) and the general
  settings' checks
- ``env``: the ``HUTCH_*`` variable of each setting
- ``resources``: host capacity (:class:`Limits`), cgroups, the TCG cache
- ``network``: address pool, resolver upstream, egress CAs, ports, :class:`NetLimits`
- ``cluster``: :class:`ClusterSettings` (role, host id, address, labels, lease)
- ``stores``: the database URL and the blob store of named snapshots
- ``meter``: :class:`MeterSettings` (prices, heartbeats, the event log)

A new setting: its field in ``settings``, its ``HUTCH_*`` name in ``env``, its check in
the module of its group (or ``load``).
"""

from __future__ import annotations

from hutch.config.cluster import (
    CLUSTER_KEYS,
    HOST_LEASE_S_RANGE,
    HOST_ROLES,
    ClusterSettings,
    parse_labels,
)
from hutch.config.load import (
    load_settings,
    parse_listen,
)
from hutch.config.meter import (
    METER_SETTINGS,
    MeterSettings,
)
from hutch.config.network import (
    DEFAULT_NET_POOL,
    NET_LIMIT_SETTINGS,
    NetLimits,
    parse_dns_upstream,
    parse_net_pool,
)
from hutch.config.resources import (
    CGROUP_CPU_QUOTA_PCT_RANGE,
    CGROUP_MEMORY_OVERHEAD_MIB_RANGE,
    CGROUP_MODES,
    TCG_TB_MIB_RANGE,
    Limits,
    host_memory_mib,
)
from hutch.config.settings import (
    ACCEL_CHOICES,
    CONSOLE_LOG_BYTES_RANGE,
    LIFECYCLE_WAIT_S_RANGE,
    MAX_DISK_LAYERS_RANGE,
    Settings,
)
from hutch.config.stores import (
    ACCEPTED_BLOB_URLS,
    DATABASE_URL_FORMS,
    S3_BUCKET_RE,
    S3_CONNECT_TIMEOUT_S_RANGE,
    check_blob_url,
    parse_database_url,
)

__all__ = [
    "ACCEL_CHOICES",
    "ACCEPTED_BLOB_URLS",
    "CGROUP_CPU_QUOTA_PCT_RANGE",
    "CGROUP_MEMORY_OVERHEAD_MIB_RANGE",
    "CGROUP_MODES",
    "CLUSTER_KEYS",
    "CONSOLE_LOG_BYTES_RANGE",
    "DATABASE_URL_FORMS",
    "DEFAULT_NET_POOL",
    "HOST_LEASE_S_RANGE",
    "HOST_ROLES",
    "LIFECYCLE_WAIT_S_RANGE",
    "MAX_DISK_LAYERS_RANGE",
    "METER_SETTINGS",
    "NET_LIMIT_SETTINGS",
    "S3_BUCKET_RE",
    "S3_CONNECT_TIMEOUT_S_RANGE",
    "TCG_TB_MIB_RANGE",
    "ClusterSettings",
    "Limits",
    "MeterSettings",
    "NetLimits",
    "Settings",
    "check_blob_url",
    "host_memory_mib",
    "load_settings",
    "parse_database_url",
    "parse_dns_upstream",
    "parse_labels",
    "parse_listen",
    "parse_net_pool",
]
