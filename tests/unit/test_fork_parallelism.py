"""How many clones of a fork start at once (hutch.services.snapshots.fork_parallelism),
and the switch for copy-on-write template memory."""

from __future__ import annotations

from hutch.config import Settings, load_settings
from hutch.services.snapshots import CLONES_PER_CPU, fork_parallelism, mem_available_mib


def test_all_clones_start_at_once_when_cpu_and_memory_allow() -> None:
    assert fork_parallelism(10, cpus=4, mem_available_mib=64_000, clone_mib=320) == 10


def test_cpus_bound_the_clones_in_flight() -> None:
    assert fork_parallelism(50, cpus=2, mem_available_mib=64_000, clone_mib=320) == (
        2 * CLONES_PER_CPU
    )
    assert fork_parallelism(50, cpus=0, mem_available_mib=None, clone_mib=320) == CLONES_PER_CPU


def test_available_memory_bounds_them_and_one_always_starts() -> None:
    assert fork_parallelism(10, cpus=16, mem_available_mib=1000, clone_mib=320) == 3
    assert fork_parallelism(10, cpus=16, mem_available_mib=100, clone_mib=320) == 1
    assert fork_parallelism(1, cpus=16, mem_available_mib=None, clone_mib=320) == 1


def test_mem_available_reads_this_host() -> None:
    mib = mem_available_mib()
    assert mib is not None and mib > 0


def test_template_ram_in_file_is_on_by_default_and_can_be_turned_off() -> None:
    assert Settings().template_ram_in_file is True
    off = load_settings(env={"HUTCH_TEMPLATE_RAM_IN_FILE": "0"})
    assert off.template_ram_in_file is False
