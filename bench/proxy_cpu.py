"""The egress proxy's own CPU per connection, on the host alone (no VM, no root).

``python -m bench.proxy_cpu [--old-src TREE] [--connections N] [--rounds R]``

The proxy (``hutch.net.proxy.EgressProxy``) runs in the daemon's data path thread and
loop (``hutch.net.datapath.Datapath`` of the tree measured); clients and the fake
internet's servers (``tests/component/proxy_env.py``: plain HTTP and TLS on 127.0.0.20)
run in the main thread. Per round: N sequential plain-HTTP GETs (Host checked, one
request relayed), N TLS handshakes passed through (SNI checked) and one 16 MiB
download; the proxy thread's CPU (``time.thread_time`` read in that thread) is divided
by the work, and for HTTP split into user and system time
(``/proc/self/task/<tid>/stat``, 10 ms ticks). The kernel's loopback work for both ends
of a connection is in the system share. Every check also asks the kernel "is this the
host?" (``is_host_address``), as the daemon does. With ``--old-src`` each round runs in
a child process per tree (this tree and that one, ``PYTHONPATH=<tree>/src``),
alternating, and the medians are printed side by side. CPU time, not wall time: on a
loaded host it moves far less than latency does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _measure(connections: int) -> dict[str, float]:
    """One round in this process: CPU µs per connection (HTTP, TLS), per MB (download)."""
    from tests.component.proxy_env import (
        BIG,
        SERVER,
        Directory,
        FakeResolver,
        http_server,
        make_cert,
        sandboxes,
    )

    from hutch.net.datapath import Datapath
    from hutch.net.egress_log import EgressLog
    from hutch.net.host_addresses import is_host_address
    from hutch.net.proxy import EgressProxy

    def forbidden(addr: IPv4Address) -> None:
        is_host_address(addr)  # the daemon's route lookup, its answer ignored: 127.0.0.20
        return None  # plays the internet here

    datapath = Datapath("proxy")  # the daemon's data path thread and its loop, as is
    datapath.start()
    proxy_loop, thread = datapath.loop, datapath.thread
    assert thread is not None

    def in_proxy(make: Callable[[], Awaitable[Any]]) -> Any:
        async def run() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(run(), proxy_loop).result()

    def proxy_cpu() -> float:
        async def read() -> float:
            return time.thread_time()

        return float(in_proxy(read))

    def proxy_user_sys() -> tuple[float, float]:
        stat = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
        f = stat.rsplit(")", 1)[1].split()
        tck = os.sysconf("SC_CLK_TCK")
        return int(f[11]) / tck, int(f[12]) / tck

    async def main() -> dict[str, float]:
        import ssl

        with tempfile.TemporaryDirectory() as d:
            crt, key = make_cert(Path(d))
            server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            server_ctx.load_cert_chain(crt, key)
            client_ctx = ssl.create_default_context(cafile=str(crt))

        async def tls_server(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(b"hello\n")
            await w.drain()
            await r.read()
            w.close()

        http = await asyncio.start_server(http_server, SERVER, 0)
        https = await asyncio.start_server(tls_server, SERVER, 0, ssl=server_ctx)
        http_port = http.sockets[0].getsockname()[1]
        https_port = https.sockets[0].getsockname()[1]
        dialled = [http_port]
        proxy = EgressProxy(
            Directory(sandboxes(https_port)), FakeResolver(), EgressLog(), forbidden,
            original_port=lambda _sock: dialled[0],
        )  # fmt: skip
        port = in_proxy(lambda: proxy.start("127.0.0.1", 0))
        src = ("127.0.0.2", 0)  # the rules sandbox of proxy_env: good.test allowed

        async def get(path: str) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, local_addr=src)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: good.test\r\n\r\n".encode())
            data = await reader.read()
            writer.close()
            return data

        async def tls() -> None:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=client_ctx, server_hostname="good.test", local_addr=src
            )
            assert await reader.readline() == b"hello\n"
            writer.close()

        out: dict[str, float] = {}
        await get("/")  # warm-up: first resolve, imports
        cpu0 = proxy_cpu()
        us0 = proxy_user_sys()
        for _ in range(connections):
            assert (await get("/")).startswith(b"HTTP/1.1 200")
        out["http_us_per_connection"] = (proxy_cpu() - cpu0) / connections * 1e6
        us1 = proxy_user_sys()
        out["http_user_us"] = (us1[0] - us0[0]) / connections * 1e6
        out["http_sys_us"] = (us1[1] - us0[1]) / connections * 1e6
        dialled[0] = https_port
        await tls()
        cpu0 = proxy_cpu()
        for _ in range(connections):
            await tls()
        out["tls_us_per_connection"] = (proxy_cpu() - cpu0) / connections * 1e6
        dialled[0] = http_port
        cpu0 = proxy_cpu()
        assert len(await get("/big")) > len(BIG)
        out["download_ms_per_mb"] = (proxy_cpu() - cpu0) / (len(BIG) / 1e6) * 1e3
        in_proxy(proxy.close)
        for server in (http, https):
            server.close()
            await server.wait_closed()
        return out

    try:
        return asyncio.run(main())
    finally:
        asyncio.run(datapath.stop())


def _child(tree: Path, connections: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(REPO)])}
    out = subprocess.run(
        [sys.executable, "-m", "bench.proxy_cpu", "--child", "--connections", str(connections)],
        cwd=REPO, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    result: dict[str, float] = json.loads(out.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-src", type=Path, help="a source tree to compare with")
    parser.add_argument("--connections", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.connections)))
        return
    trees = {"this tree": REPO}
    if args.old_src is not None:
        trees["old tree"] = args.old_src.resolve()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    print(f"load at start: {os.getloadavg()}")
    for i in range(args.rounds):
        order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]
        for name, tree in order:
            runs[name].append(_child(tree, args.connections))
    print(f"load at end: {os.getloadavg()}")
    keys = list(next(iter(runs.values()))[0])
    for key in keys:
        line = [f"{key:24}"]
        medians = []
        for name, results in runs.items():
            values = [r[key] for r in results]
            medians.append(statistics.median(values))
            each = ", ".join(f"{v:.0f}" for v in values)
            line.append(f"{name}: {medians[-1]:8.1f} ({each})")
        if len(medians) == 2:
            line.append(f"new/old {medians[0] / medians[1]:.2f}")
        print("  ".join(line))


if __name__ == "__main__":
    main()
