"""The benchmarks, in the order a full run executes them."""

from __future__ import annotations

from bench.cases.boot import run_boot, run_create
from bench.cases.common import BenchContext, Benchmark
from bench.cases.create_paths import run_create_paths
from bench.cases.cross_host import run_cross_host
from bench.cases.density import run_density
from bench.cases.dns_flood import run_dns_flood
from bench.cases.exec_rps import run_exec_rps
from bench.cases.exec_rt import run_exec
from bench.cases.files import run_files
from bench.cases.fork import run_fork
from bench.cases.meter_overhead import run_meter_overhead
from bench.cases.net import run_net
from bench.cases.net_inspect import run_net_inspect
from bench.cases.noisy import run_noisy
from bench.cases.pause_resume import run_pause_resume
from bench.cases.snapshot_blobs import run_snapshot_blobs
from bench.cases.template_blobs import run_template_blobs
from bench.cases.volumes import run_volumes

__all__ = ["BENCHMARKS", "BenchContext", "Benchmark"]

BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("boot", "cold boot to first command output", run_boot),
        Benchmark("exec", "exec round trip for `true`", run_exec),
        Benchmark(
            "meter_overhead", "exec round trip: event log on vs off (same run)", run_meter_overhead
        ),
        Benchmark("files", "file throughput host<->guest", run_files),
        Benchmark("create", "create -> first command (p50/p95)", run_create),
        Benchmark("exec_rps", "sustained exec req/s across sandboxes", run_exec_rps),
        # create_paths first of these three: it measures the cold boots that
        # pause_resume and fork compare with (they measure their own when run alone).
        Benchmark(
            "create_paths", "create: cold boot vs template vs warm pool vs bwrap", run_create_paths
        ),
        Benchmark("pause_resume", "pause/resume 512 MiB (256 MiB dirty) vs cat", run_pause_resume),
        Benchmark("fork", "fork of 10 vs cold boot and vs one resume; fork of 50", run_fork),
        Benchmark("density", "host private memory per idle clone of a template", run_density),
        Benchmark("net", "egress: enforcement path vs open NAT vs host", run_net),
        Benchmark(
            "net_inspect", "HTTPS: TLS inspection vs SNI passthrough vs open", run_net_inspect
        ),
        Benchmark("dns_flood", "another sandbox's exec during a DNS flood vs quiet", run_dns_flood),
        Benchmark("noisy", "another sandbox's echo p99 under a neighbour's load", run_noisy),
        Benchmark("volumes", "exclusive volume vs own disk writes; live grow", run_volumes),
        Benchmark("snapshot_blobs", "snapshot upload/download to S3 vs cat", run_snapshot_blobs),
        Benchmark("cross_host", "resume on another host (from S3) vs same host", run_cross_host),
        Benchmark(
            "template_blobs", "template: fetch from S3 vs build by a cold boot", run_template_blobs
        ),
    )
}
