"""Per-sandbox cgroups: the host layout, the limits, and the driver against a fake
cgroupfs directory (``tests/unit/fake_cgroupfs.py``) for v1 and v2 hosts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hutch.config import Settings, load_settings
from hutch.errors import InvalidArgument, VmError
from hutch.vm.argv import VmConfig, build_argv, in_cgroups
from hutch.vm.cgroup_driver import CgroupDriver, SandboxCgroup, record_path
from hutch.vm.cgroups import (
    CPU_PERIOD_US,
    PIDS_BASE,
    Policy,
    find_layout,
    limits_for,
    oom_kills,
    parse_mountinfo,
    v1_writes,
    v2_writes,
)
from tests.unit.fake_cgroupfs import FakeCgroupFs

POLICY = Policy(memory_overhead_mib=64, cpu_quota_pct=100)
DAEMON_PID = 4242

# What this repo's CI hosts show (a hybrid v1 host: the controllers on v1, an empty
# cgroup2 at /sys/fs/cgroup/unified), with the mount points moved under {root}.
V1_MOUNTINFO = """\
31 23 0:28 / {root} rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / {root}/cpu rw,relatime - cgroup cgroup rw,cpu
33 31 0:30 / {root}/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
35 31 0:32 / {root}/memory rw,relatime - cgroup cgroup rw,memory
38 31 0:35 / {root}/blkio rw,relatime - cgroup cgroup rw,blkio
39 31 0:36 / {root}/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / {root}/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / {root}/unified rw,relatime - cgroup2 cgroup2 rw
"""
V1_PROC_CGROUP = """\
9:name=systemd:/
8:pids:/
7:blkio:/
4:memory:/process_api/ef3c
2:cpuacct:/
1:cpu:/
0::/
"""
V2_MOUNTINFO = "30 23 0:26 / {root} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
V2_PROC_CGROUP = "0::/system.slice/hutchd.service\n"


def vm_config(tmp_path: Path, **kw: object) -> VmConfig:
    base: dict[str, object] = dict(
        name="sbx-1",
        kernel=tmp_path / "vmlinux",
        initrd=tmp_path / "initrd",
        cmdline="console=ttyS0",
        disk=tmp_path / "disk.qcow2",
        qmp_socket=tmp_path / "qmp.sock",
        agent_socket=tmp_path / "agent.sock",
        console_log=tmp_path / "console.log",
        qemu_log=tmp_path / "qemu.log",
        pidfile=tmp_path / "qemu.pid",
        accel="tcg",
        vcpus=2,
        memory_mib=256,
        tcg_tb_mib=64,
    )
    base.update(kw)
    return VmConfig(**base)  # type: ignore[arg-type]


def write_proc(tmp_path: Path, proc_cgroup: str, mountinfo: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(proc_cgroup)
    (proc / "self" / "mountinfo").write_text(mountinfo)
    return proc


@pytest.fixture
def v1(tmp_path: Path) -> tuple[FakeCgroupFs, Path, Path]:
    root = tmp_path / "cg"
    fs = FakeCgroupFs(
        {
            root / "cpu": (1, ("cpu",)),
            root / "memory": (1, ("memory",)),
            root / "blkio": (1, ("blkio",)),
            root / "pids": (1, ("pids",)),
        }
    )
    (root / "memory" / "process_api" / "ef3c").mkdir(parents=True)
    proc = write_proc(tmp_path, V1_PROC_CGROUP, V1_MOUNTINFO.format(root=root))
    return fs, root, proc


@pytest.fixture
def v2(tmp_path: Path) -> tuple[FakeCgroupFs, Path, Path]:
    root = tmp_path / "cg"
    fs = FakeCgroupFs({root: (2, ("cpuset", "cpu", "io", "memory", "pids"))})
    fs.write(root / "cgroup.subtree_control", "+cpu +io +memory +pids")
    fs.mkdir(root / "system.slice")
    fs.write(root / "system.slice" / "cgroup.subtree_control", "+cpu +io +memory +pids")
    fs.mkdir(root / "system.slice" / "hutchd.service")
    fs.add_process(root / "system.slice" / "hutchd.service", DAEMON_PID)
    proc = write_proc(tmp_path, V2_PROC_CGROUP, V2_MOUNTINFO.format(root=root))
    return fs, root, proc


def detect(fs: FakeCgroupFs, proc: Path, mode: str = "on") -> CgroupDriver:
    return CgroupDriver.detect(mode, "ab12", POLICY, fs=fs, proc=proc, pid=DAEMON_PID)


# -- limits ---------------------------------------------------------------------------


def test_limits_follow_vcpus_and_ram() -> None:
    lim = limits_for(vcpus=2, memory_mib=256, tb_mib=64, policy=POLICY)
    assert lim.memory_bytes == (256 + 64 + 64) << 20
    assert lim.cpu_weight == 200 and lim.io_weight == 200
    assert lim.cpu_quota_us == 2 * CPU_PERIOD_US
    assert lim.pids_max == PIDS_BASE + 2
    assert limits_for(1, 256, 0, Policy(64, 0)).cpu_quota_us is None
    assert limits_for(1, 256, 0, Policy(64, 50)).cpu_quota_us == CPU_PERIOD_US // 2
    # Weights stay in the range the kernel accepts however many vCPUs.
    assert limits_for(200, 256, 0, POLICY).io_weight == 1000


def test_v2_writes_turn_swap_off_and_kill_the_whole_group() -> None:
    lim = limits_for(2, 256, 64, POLICY)
    writes = {name: value for name, value, _ in v2_writes(lim)}
    assert writes["memory.max"] == str(lim.memory_bytes)
    assert writes["memory.swap.max"] == "0"
    assert writes["memory.oom.group"] == "1"
    assert writes["cpu.max"] == f"{2 * CPU_PERIOD_US} {CPU_PERIOD_US}"
    assert writes["cpu.weight"] == "200"
    assert writes["pids.max"] == str(PIDS_BASE + 2)
    assert v2_writes(limits_for(1, 256, 0, Policy(64, 0)))[4] == ("cpu.max", "max 100000", True)


def test_v1_writes_bound_memory_and_swap_together() -> None:
    lim = limits_for(1, 256, 64, POLICY)
    mem = v1_writes("memory", lim)
    # memsw after the memory limit: the kernel refuses memsw below memory.
    assert [n for n, _, _ in mem] == ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
    assert {v for _, v, _ in mem} == {str(lim.memory_bytes)}
    cpu = {n: v for n, v, _ in v1_writes("cpu", lim)}
    assert cpu == {
        "cpu.shares": "1024",
        "cpu.cfs_period_us": "100000",
        "cpu.cfs_quota_us": "100000",
    }
    with pytest.raises(InvalidArgument, match="freezer"):
        v1_writes("freezer", lim)


def test_oom_kill_count_is_read_from_either_version() -> None:
    assert oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3
    assert oom_kills("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 1\n") == 1
    assert oom_kills("") == 0


# -- the host's layout ------------------------------------------------------------------


def test_layout_of_a_hybrid_host_is_v1_with_the_daemons_groups(tmp_path: Path) -> None:
    layout = find_layout(V1_PROC_CGROUP, V1_MOUNTINFO.format(root="/sys/fs/cgroup"))
    assert not isinstance(layout, str)
    assert layout.version == 1
    dirs = {h.controllers: h.daemon_dir for h in layout.hierarchies}
    assert dirs[("memory",)] == Path("/sys/fs/cgroup/memory/process_api/ef3c")
    assert dirs[("cpu",)] == Path("/sys/fs/cgroup/cpu")
    assert set(dirs) == {("memory",), ("cpu",), ("pids",), ("blkio",)}


def test_layout_of_a_v2_host_and_of_unusable_ones() -> None:
    layout = find_layout(V2_PROC_CGROUP, V2_MOUNTINFO.format(root="/sys/fs/cgroup"))
    assert not isinstance(layout, str) and layout.version == 2
    assert layout.hierarchies[0].daemon_dir == Path("/sys/fs/cgroup/system.slice/hutchd.service")
    assert "no cgroup hierarchy" in str(find_layout(V2_PROC_CGROUP, ""))
    # A container that sees only its own sub-tree mounted: the daemon's path is outside.
    inner = "30 23 0:26 /other /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    assert "outside" in str(find_layout(V2_PROC_CGROUP, inner))


def test_mountinfo_escapes_are_undone() -> None:
    (m,) = parse_mountinfo("30 23 0:26 / /mnt/cg\\040x rw - cgroup2 cgroup2 rw\n")
    assert m.point == Path("/mnt/cg x")


# -- the driver on v1 -------------------------------------------------------------------


def test_v1_groups_are_made_with_their_limits_under_hutchs_subtree(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, root, proc = v1
    drv = detect(fs, proc)
    assert drv.enabled and drv.version == 1
    mem_sub = root / "memory" / "process_api" / "ef3c" / "hutch-ab12"
    assert set(drv.subtrees) == {
        root / "cpu" / "hutch-ab12",
        mem_sub,
        root / "blkio" / "hutch-ab12",
        root / "pids" / "hutch-ab12",
    }
    cg = drv.for_vm("sbx-1", vm_config(tmp_path))
    assert cg is not None
    cg.create()
    limit = str((256 + 64 + 64) << 20)
    assert (mem_sub / "sbx-1" / "memory.limit_in_bytes").read_text().strip() == limit
    assert (mem_sub / "sbx-1" / "memory.memsw.limit_in_bytes").read_text().strip() == limit
    cpu = root / "cpu" / "hutch-ab12" / "sbx-1"
    assert (cpu / "cpu.cfs_quota_us").read_text().strip() == "200000"
    assert (cpu / "cpu.shares").read_text().strip() == "2048"
    pids = root / "pids" / "hutch-ab12" / "sbx-1" / "pids.max"
    assert pids.read_text().strip() == str(PIDS_BASE + 2)
    assert (root / "blkio" / "hutch-ab12" / "sbx-1" / "blkio.weight").read_text().strip() == "200"
    # Nothing outside hutch's sub-tree was written.
    assert all("hutch-ab12" in str(p) for p, _ in fs.written)
    assert sorted(map(str, cg.procs_files())) == sorted(
        str(s / "sbx-1" / "cgroup.procs") for s in drv.subtrees
    )


def test_an_oom_kill_is_seen_and_removal_kills_stragglers(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, _, proc = v1
    drv = detect(fs, proc)
    cg = drv.for_vm("sbx-1", vm_config(tmp_path))
    assert cg is not None
    cg.create()
    assert cg.oom_kills() == 0
    mem = next(d for d in cg.dirs if (d / "memory.oom_control").exists())
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert cg.oom_kills() == 1
    for d in cg.dirs:
        fs.add_process(d, 777)
    cg.remove()
    assert fs.killed and set(fs.killed) == {777}
    assert not any(d.exists() for d in cg.dirs)
    assert drv.group_names() == set()
    cg.remove()  # idempotent
    assert cg.oom_kills() == 0  # gone: no count, no error


def test_a_failed_create_leaves_nothing_and_says_how_to_run_without(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, _, proc = v1
    drv = detect(fs, proc)
    # A kernel without the memory limit file: a required write fails.
    real_mkdir = fs.mkdir

    def mkdir_without_limit(path: Path) -> None:
        real_mkdir(path)
        (path / "memory.limit_in_bytes").unlink(missing_ok=True)

    fs.mkdir = mkdir_without_limit  # type: ignore[method-assign]
    cg = drv.for_vm("sbx-1", vm_config(tmp_path))
    assert cg is not None
    with pytest.raises(VmError, match=r"cgroup of sbx-1.*HUTCH_CGROUPS=off"):
        cg.create()
    assert not any(d.exists() for d in cg.dirs)


def test_the_record_beside_the_pidfile_finds_the_group_again(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, _, proc = v1
    drv = detect(fs, proc)
    cfg = vm_config(tmp_path)
    cg = drv.for_vm("sbx-1", cfg)
    assert cg is not None
    cg.create()
    rec = record_path(cfg.pidfile)
    cg.save(rec)
    again = SandboxCgroup.load(rec, fs)
    assert again == cg
    # A later daemon (another policy, even cgroups off) still releases it.
    off = CgroupDriver.detect("off", "ab12", POLICY, fs=fs, proc=proc)
    off.release("sbx-1", rec)
    assert not any(d.exists() for d in cg.dirs) and not rec.exists()


def test_a_record_naming_foreign_groups_is_never_trusted(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, root, _ = v1
    victim = root / "memory" / "process_api"
    rec = tmp_path / "cgroup.json"
    for dirs in ([str(victim)], [str(root / "memory" / "hutch-ab12" / "..")], ["rel/hutch-1/x"]):
        data = {
            "format": 1,
            "version": 1,
            "dirs": dirs,
            "controllers": [["memory"]],
            "limits": {
                "cpu_weight": 100,
                "cpu_quota_us": None,
                "memory_bytes": 1,
                "io_weight": 100,
                "pids_max": 1,
            },
        }
        rec.write_text(json.dumps(data))
        assert SandboxCgroup.load(rec, fs) is None
    rec.write_text("{not json")
    assert SandboxCgroup.load(rec, fs) is None
    assert victim.exists()


def test_reclaim_removes_only_the_groups_asked_for(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, _, proc = v1
    drv = detect(fs, proc)
    for name in ("tpl-1", "sbx-1"):
        cg = drv.for_vm(name, vm_config(tmp_path))
        assert cg is not None
        cg.create()
    assert drv.group_names() == {"tpl-1", "sbx-1"}
    assert drv.reclaim(lambda n: n.startswith("tpl-")) == ["tpl-1"]
    assert drv.group_names() == {"sbx-1"}
    # A restarted daemon (same tag) sees the group a crashed one left.
    assert detect(fs, proc).group_names() == {"sbx-1"}


def test_close_removes_the_empty_subtree_only(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, _, proc = v1
    drv = detect(fs, proc)
    cg = drv.for_vm("sbx-1", vm_config(tmp_path))
    assert cg is not None
    cg.create()
    drv.close()
    assert all(s.exists() for s in drv.subtrees)  # a group still there: kept
    cg.remove()
    drv.close()
    assert not any(s.exists() for s in drv.subtrees)


def test_names_that_are_not_one_path_component_are_refused(
    v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, _, proc = v1
    drv = detect(fs, proc)
    for bad in ("..", "a/b", "", ".hidden"):
        with pytest.raises(VmError, match="cannot name a cgroup"):
            drv.for_vm(bad, vm_config(tmp_path))


# -- the driver on v2 -------------------------------------------------------------------


def test_v2_daemon_moves_into_a_leaf_and_enables_controllers(
    v2: tuple[FakeCgroupFs, Path, Path], tmp_path: Path
) -> None:
    fs, root, proc = v2
    service = root / "system.slice" / "hutchd.service"
    drv = detect(fs, proc)
    assert drv.version == 2 and drv.subtrees == (service / "hutch-ab12",)
    assert fs.procs(service) == [] and fs.procs(service / "hutchd") == [DAEMON_PID]
    enabled = set((service / "hutch-ab12" / "cgroup.subtree_control").read_text().split())
    assert {"memory", "cpu", "io", "pids"} <= enabled
    cg = drv.for_vm("sbx-1", vm_config(tmp_path, vcpus=1, memory_mib=512))
    assert cg is not None
    cg.create()
    d = service / "hutch-ab12" / "sbx-1"
    assert (d / "memory.max").read_text().strip() == str((512 + 64 + 64) << 20)
    assert (d / "memory.swap.max").read_text().strip() == "0"
    assert (d / "cpu.max").read_text().strip() == "100000 100000"
    assert (d / "io.weight").read_text().strip() == "default 100"
    (d / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert cg.oom_kills() == 1
    # A second daemon start (hutchd already in its leaf) changes nothing.
    assert detect(fs, proc).subtrees == drv.subtrees


def test_v2_refuses_a_cgroup_shared_with_other_processes(
    v2: tuple[FakeCgroupFs, Path, Path],
) -> None:
    fs, root, proc = v2
    fs.add_process(root / "system.slice" / "hutchd.service", 999)
    with pytest.raises(VmError, match=r"holds other processes \(999\).*HUTCH_CGROUPS"):
        detect(fs, proc, "on")
    drv = detect(fs, proc, "auto")
    assert not drv.enabled and "other processes" in (drv.reason or "")
    assert drv.for_vm("sbx-1", vm_config(root)) is None


def test_modes(v1: tuple[FakeCgroupFs, Path, Path], tmp_path: Path) -> None:
    fs, _, proc = v1
    off = detect(fs, proc, "off")
    assert not off.enabled and off.for_vm("sbx-1", vm_config(tmp_path)) is None
    with pytest.raises(VmError, match="accepted: auto, on, off"):
        detect(fs, proc, "maybe")
    nothing = write_proc(tmp_path / "bare", V2_PROC_CGROUP, "")
    with pytest.raises(VmError, match="HUTCH_CGROUPS=on, but cgroups cannot be used"):
        detect(fs, nothing, "on")


def test_auto_without_cgroups_warns_loudly(
    tmp_path: Path, v1: tuple[FakeCgroupFs, Path, Path], caplog: pytest.LogCaptureFixture
) -> None:
    fs, _, proc = v1
    nothing = write_proc(tmp_path / "bare", V2_PROC_CGROUP, "")
    drv = detect(fs, nothing, "auto")
    assert not drv.enabled
    assert "sandboxes run without host limits" in caplog.text
    caplog.clear()
    detect(fs, proc, "off")
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "HUTCH_CGROUPS=off" in caplog.text and "without host limits" in caplog.text


# -- QEMU's command line and the settings ------------------------------------------------


def test_qemu_joins_its_groups_before_it_runs(tmp_path: Path) -> None:
    argv = ["qemu-system-x86_64", "-M", "microvm"]
    assert in_cgroups([], argv) == argv
    wrapped = in_cgroups([Path("/cg/a/cgroup.procs"), Path("/cg/b/cgroup.procs")], argv)
    assert wrapped[0] == "/bin/sh" and wrapped[-4:] == ["--", *argv]
    assert "/cg/a/cgroup.procs" in wrapped and "/cg/b/cgroup.procs" in wrapped
    with pytest.raises(InvalidArgument):
        in_cgroups([Path("--")], argv)


def test_the_join_script_really_joins_and_fails_closed(tmp_path: Path) -> None:
    import subprocess

    procs = tmp_path / "cgroup.procs"
    procs.write_text("")
    out = subprocess.run(
        in_cgroups([procs], ["/bin/sh", "-c", "echo $$"]), capture_output=True, text=True
    )
    assert out.returncode == 0 and procs.read_text().strip() == out.stdout.strip()
    missing = subprocess.run(
        in_cgroups([tmp_path / "nope" / "cgroup.procs"], ["/bin/true"]), capture_output=True
    )
    assert missing.returncode == 125  # never runs outside its group


def test_tcg_translation_cache_is_bounded_on_the_command_line(tmp_path: Path) -> None:
    argv = build_argv(vm_config(tmp_path, tcg_tb_mib=64))
    assert "tcg,thread=multi,tb-size=64" in argv
    with pytest.raises(InvalidArgument, match="tcg_tb_mib"):
        build_argv(vm_config(tmp_path, tcg_tb_mib=1))


def test_cgroup_settings_from_the_environment(tmp_path: Path) -> None:
    env = {
        "HUTCH_STATE_DIR": str(tmp_path),
        "HUTCH_CGROUPS": "off",
        "HUTCH_CGROUP_MEMORY_OVERHEAD_MIB": "128",
        "HUTCH_CGROUP_CPU_QUOTA_PCT": "0",
        "HUTCH_TCG_TB_MIB": "32",
    }
    s = load_settings(env=env)
    assert (s.cgroups, s.cgroup_memory_overhead_mib, s.cgroup_cpu_quota_pct) == ("off", 128, 0)
    assert s.tcg_tb_mib == 32
    assert Settings().cgroups == "auto"
    for key, bad, accepted in (
        ("HUTCH_CGROUPS", "yes", "auto, on, off"),
        ("HUTCH_CGROUP_MEMORY_OVERHEAD_MIB", "1", "16-65536"),
        ("HUTCH_CGROUP_CPU_QUOTA_PCT", "5", "10-10000"),
        ("HUTCH_TCG_TB_MIB", "x", "8-2048"),
    ):
        with pytest.raises(InvalidArgument, match=rf"{key}=.*accepted: {accepted}"):
            load_settings(env={**env, key: bad})
