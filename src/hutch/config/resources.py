"""Host capacity and what one sandbox's QEMU may use of the host: the sandbox and memory
limits, the per-sandbox cgroups and the TCG translation cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hutch.config.env import _ENV_OF
from hutch.errors import InvalidArgument

if TYPE_CHECKING:
    from hutch.config.settings import Settings

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


def host_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1 << 20)


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
