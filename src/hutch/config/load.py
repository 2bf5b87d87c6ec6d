"""Reading the settings: the ``HUTCH_*`` environment over the TOML config file over the
defaults, each value checked with a message naming what is accepted."""

from __future__ import annotations

import os
import tomllib
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from hutch.config.cluster import CLUSTER_KEYS, _cluster_settings
from hutch.config.env import _ENV, _number
from hutch.config.meter import METER_SETTINGS, _meter_settings
from hutch.config.network import NET_LIMIT_SETTINGS, _net_limits_settings, _network_settings
from hutch.config.resources import _cgroup_settings
from hutch.config.settings import (
    ACCEL_CHOICES,
    CONSOLE_LOG_BYTES_RANGE,
    LIFECYCLE_WAIT_S_RANGE,
    MAX_DISK_LAYERS_RANGE,
    Settings,
)
from hutch.config.stores import _blob_settings, parse_database_url
from hutch.errors import InvalidArgument


def parse_listen(value: str, name: str = "HUTCH_LISTEN") -> tuple[str, int]:
    """Parse ``host:port`` (``[v6]:port`` for IPv6)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgument(f"{name}={value!r} is not host:port (example: 127.0.0.1:7070)")
    return host.strip("[]"), int(port)


def _flag(values: dict[str, Any], key: str, source: str) -> bool:
    flag = str(values[key]).lower()
    if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise InvalidArgument(f"{source}: {key}={flag!r}; accepted: 1/0, true/false")
    return flag in ("1", "true", "yes", "on")


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
            s = replace(s, templates=_flag(values, "templates", source))
        if "blob_builtin_images" in values:
            flag = _flag(values, "blob_builtin_images", source)
            s = replace(s, blob_builtin_images=flag)
        if "template_ram_in_file" in values:
            s = replace(s, template_ram_in_file=_flag(values, "template_ram_in_file", source))
        if "fork_ram_in_file" in values:
            s = replace(s, fork_ram_in_file=_flag(values, "fork_ram_in_file", source))
        if "guest_aslr" in values:
            s = replace(s, guest_aslr=_flag(values, "guest_aslr", source))
        if "pool_size" in values:
            s = replace(s, pool_size=int(values["pool_size"]))
            if not 0 <= s.pool_size <= 32:
                raise InvalidArgument(f"{source}: pool_size={s.pool_size}; accepted: 0-32")
        s = _network_settings(s, values, source)
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
        s = _net_limits_settings(s, values, source)
        s = _meter_settings(s, values, source)
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
