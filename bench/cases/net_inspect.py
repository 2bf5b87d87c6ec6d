"""``net_inspect``: what TLS inspection costs, in one run: an HTTPS connect + TLS
handshake + GET, and the throughput of one HTTPS download, from a sandbox through
hutch's proxy terminating TLS (``inspection: full``) vs the proxy passing TLS through
after its SNI check (rule list ``good.test``) vs open egress (NAT, no proxy), against
the fake internet (``tests.netfake``). The goal (issue 12): full within 2x of open for
both.

Under ``full`` each request costs two handshakes (guest <-> proxy with a leaf from the
daemon's CA, proxy <-> server verified against ``HUTCH_EGRESS_UPSTREAM_CA``, here the
fake internet's test CA) plus the per-request decision; the guest trusts hutch's CA from
its system bundle (installed when the policy was set). The guest times its own requests
(``tests/netfake/probe.py`` ``latency`` op), rounds interleave the three paths on one
sandbox (the policy is switched live). Needs root; runs on a side daemon.
"""

from __future__ import annotations

import os
import subprocess

from tests.netfake import FakeInternet, free_net_pool

from bench.cases.common import SANDBOX_MEMORY_MIB, SANDBOX_VCPUS, BenchContext
from bench.cases.guest_probe import install_probe, run_probe
from bench.model import BenchResult, Metric, SampleSet
from hutch import Sandbox
from hutch.config import Settings

__all__ = ["run_net_inspect"]

MB = 1e6

FULL = {"inspection": "full", "rules": [{"action": "allow", "host": "good.test"}]}
BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # hutch's CA is in it under full
FAKE_CA = "/root/fakenet-ca.pem"


def _set(sb: Sandbox, mode: str) -> str:
    """Switch the sandbox to ``mode``; returns the CA file its client must trust."""
    if mode == "full":
        sb.egress.set(policy=FULL)
        return BUNDLE
    sb.egress.set(["good.test"] if mode == "passthrough" else [])
    return FAKE_CA


def run_net_inspect(ctx: BenchContext) -> BenchResult:
    if os.geteuid() != 0:
        raise RuntimeError("the net_inspect benchmark needs root (a network namespace)")
    rounds, per_round, size = (2, 10, 8 << 20) if ctx.quick else (3, 30, 32 << 20)
    params = {
        "rounds": rounds,
        "requests_per_round": per_round,
        "download_bytes": size,
        "request": "TCP connect + TLS handshake + GET / (HTTP/1.1, ~300 byte JSON) + close",
        "full_policy": FULL,
        "image": ctx.image,
        "vcpus": SANDBOX_VCPUS,
        "memory_mib": SANDBOX_MEMORY_MIB,
    }
    result = BenchResult(
        "net_inspect", "HTTPS: TLS inspection vs SNI passthrough vs open", ctx.quick, params
    )
    lat: dict[str, list[float]] = {"full": [], "passthrough": [], "direct": []}
    rate: dict[str, list[float]] = {"full": [], "passthrough": [], "direct": []}
    with FakeInternet() as net:
        env = {"HUTCH_NET_POOL": free_net_pool(), "HUTCH_EGRESS_UPSTREAM_CA": str(net.ca_cert)}
        side = ctx.side_daemon("net_inspect", {**env, **net.env()})
        try:
            sb = Sandbox.create(
                ctx.image, vcpus=SANDBOX_VCPUS, memory_mib=SANDBOX_MEMORY_MIB, client=side.client
            )
            with sb:
                install_probe(sb)
                sb.files.write(FAKE_CA, net.ca_cert.read_bytes())
                check = {"op": "latency", "addr": net.web, "host": "good.test", "sni": "good.test"}
                download = {**check, "op": "get", "size": size}
                for mode in lat:  # untimed warm-up (ARP, conntrack, the leaf, resolves)
                    run_probe(sb, [{**check, "ca": _set(sb, mode), "count": 3, "timeout": 30}])
                for i in range(rounds):
                    ctx.log(f"  round {i + 1}/{rounds}")
                    for mode in lat:
                        ca = _set(sb, mode)
                        timed = {**check, "ca": ca, "count": per_round, "timeout": 30}
                        [r] = run_probe(sb, [timed])
                        lat[mode] += r["samples"]
                        [d] = run_probe(sb, [{**download, "ca": ca, "timeout": 300}])
                        rate[mode].append(size / d["seconds"] / MB)
        finally:
            ctx.stop_side_daemon("net_inspect")
            tag = Settings(state_dir=side.daemon.state_dir).daemon_tag
            subprocess.run(["nft", "delete", "table", "inet", f"hutch_{tag}"], capture_output=True)
    labels = {
        "full": "sandbox, inspection full (TLS terminated by hutch)",
        "passthrough": "sandbox, egress ['good.test'] (SNI checked, TLS passed through)",
        "direct": "sandbox, open egress (NAT)",
    }
    for a, b in (("full", "direct"), ("passthrough", "direct"), ("full", "passthrough")):
        result.metrics.append(
            Metric(
                f"https_get_{a}_vs_{b}",
                "s",
                "lower",
                "HTTPS connect + handshake + small GET, timed where the client runs",
                SampleSet(labels[a], lat[a]),
                SampleSet(labels[b], lat[b]),
            )
        )
    for a, b in (("full", "direct"), ("passthrough", "direct")):
        result.metrics.append(
            Metric(
                f"https_download_{a}_vs_{b}",
                "MB/s",
                "higher",
                f"GET of {size >> 20} MiB over HTTPS (HTTP/1.0), one connection",
                SampleSet(labels[a], rate[a]),
                SampleSet(labels[b], rate[b]),
            )
        )
    for m in result.metrics:
        ctx.log(f"  {m.name}: {m.hutch.headline:.4g} vs {m.baseline.headline:.4g} {m.unit}"
                if m.baseline else f"  {m.name}")  # fmt: skip
    return result
