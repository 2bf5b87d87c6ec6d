"""The ``HUTCH_*`` environment variables, each by the setting it sets, and the number
parser every group of settings shares."""

from __future__ import annotations

from typing import Any, TypeVar

from hutch.errors import InvalidArgument

_N = TypeVar("_N", int, float)


def _number(values: dict[str, Any], key: str, kind: type[_N], source: str) -> _N:
    try:
        return kind(values[key])
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{source}: {key}={values[key]!r} is not a number") from exc


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
    "HUTCH_FORK_RAM_IN_FILE": "fork_ram_in_file",
    "HUTCH_GUEST_ASLR": "guest_aslr",
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
    "HUTCH_S3_CONNECT_TIMEOUT_S": "s3_connect_timeout_s",
    "HUTCH_BLOB_CACHE_BYTES": "blob_cache_bytes",
    "HUTCH_BLOB_BUILTIN_IMAGES": "blob_builtin_images",
}
_ENV_OF = {key: name for name, key in _ENV.items()}
