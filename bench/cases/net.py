"""``net``: connection setup latency and download throughput from a sandbox to a fake
internet (``tests.netfake``), through the enforcement path vs the unfiltered path vs the
host itself, all in one run.

- **rules** (enforcement): the sandbox has egress ``["good.test"]``, so its port-80
  connections go through hutch's Host/SNI proxy, which checks the name, resolves it
  itself and connects.
- **open** (unfiltered): the same sandbox with no rules: plain forwarding and NAT.
- **host**: the same requests from the host straight to the fake internet (no VM).

The guest times its own requests (``tests/netfake/probe.py`` ``latency``/``get`` ops),
so the exec round trip that starts each batch is not in the samples. Rounds interleave
the three paths (rules are switched live on the one sandbox) so drifting load hits all
alike. Needs root (the fake internet is a network namespace); runs on a side daemon
``net`` with its own address pool and ``HUTCH_DNS_UPSTREAM`` at the fake DNS server.

Each latency batch also reads the side daemon's CPU time (every thread's
``/proc/<pid>/task/*/schedstat``, nanoseconds) before and after: ``hutchd_cpu_per_connect``
is that time over the batch's connections. The batch's one exec costs the daemon the
same on both paths, so rules minus open is what the proxy spends per connection.
``datapath_cpu_per_connect`` is the same without the main thread (the API's loop): the
data path's thread and a few helpers (QEMU waitpid watchers, subprocess threads).

The side daemon runs without templates or a pool (``QUIET_ENV``): with templates on, its
first create starts a template build in the background, a second TCG guest booting and
being frozen by the daemon (sha256 of its files in the daemon's API loop) while the
rounds are timed. That costs the open path little (the kernel forwards its packets) and
the rules path a lot (every connection needs the proxy's thread scheduled, and it shares
the two cores and the interpreter lock with that build): it measured the build, not
the proxy.

``HUTCH_BENCH_OLD_SRC=<source tree>`` (e.g. ``git archive main | tar -x -C /tmp/old``)
adds a second side daemon ``net-old`` run from that tree (this venv), with its own
sandbox; each round then takes the rules and open samples on both daemons, one after
the other (which goes first alternates), and the ``*_old`` and ``*_new_vs_old``
metrics compare them.
"""

from __future__ import annotations

import os
import subprocess
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.netfake import FakeInternet, free_net_pool
from tests.netfake.probe import run_checks

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext
from bench.cases.guest_probe import install_probe, run_probe
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox
from hutch.config import Settings

__all__ = ["run_net"]

MB = 1e6
#: No background template build or pool refill competing with the timed rounds.
QUIET_ENV = {"HUTCH_TEMPLATES": "0", "HUTCH_POOL_SIZE": "0"}


def _host(checks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = run_checks(checks)
    bad = [r for r in results if not r.get("ok")]
    if bad:
        raise RuntimeError(f"host probe failed: {bad}")
    return results


@dataclass
class _Path:
    """One daemon's sandbox and the samples taken through it."""

    name: str
    sb: Sandbox
    pid: int
    lat: dict[str, list[float]] = field(default_factory=lambda: {"rules": [], "open": []})
    rate: dict[str, list[float]] = field(default_factory=lambda: {"rules": [], "open": []})
    cpu: dict[str, list[float]] = field(default_factory=lambda: {"rules": [], "open": []})
    side_cpu: dict[str, list[float]] = field(default_factory=lambda: {"rules": [], "open": []})


def _cpu_s(pid: int) -> tuple[float, float]:
    """CPU time of ``pid`` so far (s): every thread's, and every thread's but the main
    one (the API's loop), that is the data path's thread and a few helpers (scheduler
    statistics, ns precision: the tick-based ``stat`` fields are 10 ms coarse, about
    what a few connections cost)."""
    total = main = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        total += ns
        if task.name == str(pid):
            main = ns
    return total / 1e9, (total - main) / 1e9


def _old_repo() -> Path | None:
    old_src = os.environ.get("HUTCH_BENCH_OLD_SRC")
    if not old_src:
        return None
    repo = Path(old_src).resolve()
    if not (repo / "src" / "hutch").is_dir():
        raise RuntimeError(f"HUTCH_BENCH_OLD_SRC={old_src}: no src/hutch in it")
    return repo


def _drop_table(state_dir: Path) -> None:
    # A stopping daemon keeps its nft table for sandboxes that outlive it; this one has
    # none left, so the table would only pile up run after run.
    tag = Settings(state_dir=state_dir).daemon_tag
    subprocess.run(["nft", "delete", "table", "inet", f"hutch_{tag}"], capture_output=True)


def run_net(ctx: BenchContext) -> BenchResult:
    if os.geteuid() != 0:
        raise RuntimeError("the net benchmark needs root (it builds a network namespace)")
    rounds, per_round, size = (2, 10, 8 << 20) if ctx.quick else (3, 30, 32 << 20)
    params = {
        "rounds": rounds,
        "requests_per_round": per_round,
        "download_bytes": size,
        "rules": ["good.test"],
        "request": "TCP connect + GET / (HTTP/1.0, ~200 byte JSON answer) + read to close",
        "image": ctx.image,
        "vcpus": SANDBOX_VCPUS,
        "memory_mib": SANDBOX_MEMORY_MIB,
        "side_daemon_env": QUIET_ENV,
        "old_src": None,
    }
    old_repo = _old_repo()
    params["old_src"] = str(old_repo) if old_repo else None
    result = BenchResult("net", "egress: enforcement path vs open NAT vs host", ctx.quick, params)
    host_lat: list[float] = []
    host_rate: list[float] = []
    paths: list[_Path] = []
    with FakeInternet() as net, ExitStack() as stack:
        latency = {"op": "latency", "addr": net.web, "host": "good.test"}
        download = {"op": "get", "addr": net.web, "host": "good.test", "size": size}
        daemons: list[tuple[str, Path | None]] = [("net", None)]
        if old_repo is not None:
            daemons.append(("net-old", old_repo))
        for name, repo in daemons:
            env = {"HUTCH_NET_POOL": free_net_pool(), **net.env(), **QUIET_ENV}
            side = ctx.side_daemon(name, env, repo)
            stack.callback(_drop_table, side.daemon.state_dir)
            stack.callback(ctx.stop_side_daemon, name)
            sb = Sandbox.create(
                ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=side.client
            )
            stack.enter_context(sb)
            install_probe(sb)
            sb.files.write("/root/fakenet-ca.pem", net.ca_cert.read_bytes())
            # Untimed warm-up of every path (ARP, conntrack, proxy's first resolve).
            for rules in (["good.test"], []):
                sb.egress.set(rules)
                run_probe(sb, [{**latency, "count": 3}])
            if side.daemon.pid is None:
                raise RuntimeError(f"side daemon {name} is not running")
            paths.append(_Path(name, sb, side.daemon.pid))
        _host([{**latency, "count": 3}])
        for i in range(rounds):
            ctx.log(f"  round {i + 1}/{rounds}")
            # Which daemon goes first alternates, so neither always follows the other.
            for path in paths if i % 2 == 0 else paths[::-1]:
                for mode, rules in (("rules", ["good.test"]), ("open", [])):
                    path.sb.egress.set(rules)
                    cpu0, side0 = _cpu_s(path.pid)
                    [r] = run_probe(path.sb, [{**latency, "count": per_round, "timeout": 30}])
                    cpu1, side1 = _cpu_s(path.pid)
                    path.cpu[mode].append((cpu1 - cpu0) / per_round)
                    path.side_cpu[mode].append((side1 - side0) / per_round)
                    path.lat[mode] += r["samples"]
                    [d] = run_probe(path.sb, [{**download, "timeout": 120}])
                    path.rate[mode].append(size / d["seconds"] / MB)
            [r] = _host([{**latency, "count": per_round}])
            host_lat += r["samples"]
            [d] = _host([{**download, "timeout": 120}])
            host_rate.append(size / d["seconds"] / MB)
        for path in paths:
            counters = path.sb.egress.get()
            result.notes.append(
                f"egress counters of {path.name}'s sandbox after the run: allowed "
                f"{counters.allowed}, denied {counters.denied}"
            )
    new = paths[0]
    lat = {**new.lat, "host": host_lat}
    rate = {**new.rate, "host": host_rate}
    labels = {
        "rules": "sandbox, egress ['good.test'] (Host proxy)",
        "open": "sandbox, open egress (NAT)",
        "host": "host -> fake internet directly",
    }
    pairs = (("rules", "open"), ("open", "host"), ("rules", "host"))
    for a, b in pairs:
        result.metrics.append(
            Metric(
                f"connect_get_{a}_vs_{b}",
                "s",
                "lower",
                "connection setup + small HTTP GET, timed where the client runs",
                SampleSet(labels[a], lat[a]),
                SampleSet(labels[b], lat[b]),
            )
        )
    for a, b in pairs:
        result.metrics.append(
            Metric(
                f"download_{a}_vs_{b}",
                "MB/s",
                "higher",
                f"GET of {size >> 20} MiB over HTTP, one connection",
                SampleSet(labels[a], rate[a]),
                SampleSet(labels[b], rate[b]),
            )
        )
    result.metrics += _cpu_metrics("", new, labels)
    if len(paths) > 1:
        old = paths[1]
        result.metrics += _cpu_metrics("_old", old, labels)
        result.metrics.append(
            Metric(
                "hutchd_cpu_per_connect_rules_new_vs_old",
                "s",
                "lower",
                "hutchd's CPU per proxied connection (+ its share of the batch's exec): "
                "this tree vs HUTCH_BENCH_OLD_SRC",
                SampleSet("hutchd, rules, this tree", new.cpu["rules"]),
                SampleSet("hutchd, rules, old tree", old.cpu["rules"]),
            )
        )
        result.metrics.append(
            Metric(
                "datapath_cpu_per_connect_rules_new_vs_old",
                "s",
                "lower",
                "hutchd's CPU besides the API's thread (the data path's) per proxied "
                "connection: this tree vs HUTCH_BENCH_OLD_SRC",
                SampleSet("data path, rules, this tree", new.side_cpu["rules"]),
                SampleSet("data path, rules, old tree", old.side_cpu["rules"]),
            )
        )
        _old_metrics(result, new, old, labels["rules"], labels["open"], size)
    for m in result.metrics:
        ctx.log(f"  {m.name}: {m.hutch.headline:.4g} vs {m.baseline.headline:.4g} {m.unit}"
                if m.baseline else f"  {m.name}")  # fmt: skip
    return result


def _old_metrics(
    result: BenchResult, new: _Path, old: _Path, rules: str, open_: str, size: int
) -> None:
    """The old tree's own ratios and this tree against it (``HUTCH_BENCH_OLD_SRC``)."""
    result.metrics += [
        Metric(
            "connect_get_rules_vs_open_old",
            "s",
            "lower",
            "connection setup + small HTTP GET, on the daemon from HUTCH_BENCH_OLD_SRC",
            SampleSet(f"{rules}, old tree", old.lat["rules"]),
            SampleSet(f"{open_}, old tree", old.lat["open"]),
        ),
        Metric(
            "connect_get_rules_new_vs_old",
            "s",
            "lower",
            "connection setup + small HTTP GET through the proxy: this tree vs the old",
            SampleSet(f"{rules}, this tree", new.lat["rules"]),
            SampleSet(f"{rules}, old tree", old.lat["rules"]),
        ),
        Metric(
            "download_rules_vs_open_old",
            "MB/s",
            "higher",
            f"GET of {size >> 20} MiB over HTTP, on the daemon from HUTCH_BENCH_OLD_SRC",
            SampleSet(f"{rules}, old tree", old.rate["rules"]),
            SampleSet(f"{open_}, old tree", old.rate["open"]),
        ),
        Metric(
            "download_rules_new_vs_old",
            "MB/s",
            "higher",
            f"GET of {size >> 20} MiB through the proxy: this tree vs the old",
            SampleSet(f"{rules}, this tree", new.rate["rules"]),
            SampleSet(f"{rules}, old tree", old.rate["rules"]),
        ),
    ]


def _cpu_metrics(suffix: str, path: _Path, labels: dict[str, str]) -> list[Metric]:
    tree = ", old tree" if suffix else ""
    return [
        Metric(
            f"hutchd_cpu_per_connect_rules_vs_open{suffix}",
            "s",
            "lower",
            "the side daemon's CPU (all threads) over a latency batch, per connection",
            SampleSet(f"hutchd, {labels['rules']}{tree}", path.cpu["rules"]),
            SampleSet(f"hutchd, {labels['open']}{tree}", path.cpu["open"]),
        ),
        Metric(
            f"datapath_cpu_per_connect_rules_vs_open{suffix}",
            "s",
            "lower",
            "the side daemon's CPU besides the API's thread (the data path's thread and "
            "helpers) over a latency batch, per connection",
            SampleSet(f"data path, {labels['rules']}{tree}", path.side_cpu["rules"]),
            SampleSet(f"data path, {labels['open']}{tree}", path.side_cpu["open"]),
        ),
    ]
