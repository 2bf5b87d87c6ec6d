"""Tap devices on the host (via iproute2), and the one sysctl sandbox routing needs.

Every function takes ``netns``: None is the current network namespace (production);
the privileged tests pass a scratch namespace so the real host is never touched.
All changes are idempotent so that reconcile after a crash can simply re-run them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from ipaddress import IPv4Address

from hutch.errors import NetworkError

__all__ = [
    "create_tap",
    "delete_tap",
    "enable_ip_forward",
    "link_exists",
    "list_links",
    "run_command",
    "run_ip",
]


def _in_netns(argv: Sequence[str], netns: str | None) -> list[str]:
    return ["ip", "netns", "exec", netns, *argv] if netns else list(argv)


async def run_command(
    argv: Sequence[str], *, netns: str | None = None, stdin: bytes | None = None
) -> tuple[int, str, str]:
    """Run ``argv`` (inside ``netns`` when given); return (exit code, stdout, stderr).

    Raises ``NetworkError`` only when the program cannot be started at all.
    """
    full = _in_netns(argv, netns)
    try:
        proc = await asyncio.create_subprocess_exec(
            *full,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise NetworkError(
            f"cannot run {full[0]!r} ({exc}); install iproute2 and nftables and run as root"
        ) from exc
    out, err = await proc.communicate(stdin)
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def run_ip(args: Sequence[str], *, netns: str | None = None) -> str:
    """``ip ARGS`` (inside ``netns``); stdout, or ``NetworkError`` with ip's stderr."""
    code, out, err = await run_command(["ip", *args], netns=netns)
    if code != 0:
        raise NetworkError(f"`ip {' '.join(args)}` failed (exit {code}): {err.strip()}")
    return out


async def link_exists(name: str, *, netns: str | None = None) -> bool:
    code, _, _ = await run_command(["ip", "link", "show", "dev", name], netns=netns)
    return code == 0


async def create_tap(
    name: str,
    gateway: IPv4Address,
    prefix: int = 30,
    *,
    owner: int | None = None,
    netns: str | None = None,
) -> None:
    """Create persistent tap ``name`` with host address ``gateway/prefix``, link up.

    Idempotent: an existing tap keeps its identity and gets exactly this one IPv4 address
    (stale ones from an earlier lease are removed). IPv6 is disabled on it so the host
    never autoconfigures or answers neighbour discovery there (guests are IPv4 only).
    QEMU attaches to it later with ``-netdev tap,ifname=NAME,script=no``; ``owner`` (a
    uid) lets a QEMU that runs unprivileged open it (set at creation only).
    Raises ``NetworkError`` naming the failing command.
    """
    if len(name) > 15:
        raise NetworkError(f"interface name {name!r} is longer than 15 characters")
    if not await link_exists(name, netns=netns):
        user = ["user", str(owner)] if owner is not None else []
        await run_ip(["tuntap", "add", "dev", name, "mode", "tap", *user], netns=netns)
    # The sysctl exists once the link does; failing it is not fatal to the data path
    # (nft drops IPv6 from taps anyway), so its result is not checked.
    await run_command(["sysctl", "-q", "-w", f"net.ipv6.conf.{name}.disable_ipv6=1"], netns=netns)
    await run_ip(["addr", "replace", f"{gateway}/{prefix}", "dev", name], netns=netns)
    await _drop_other_addresses(name, f"{gateway}/{prefix}", netns)
    await run_ip(["link", "set", "dev", name, "up"], netns=netns)


async def _drop_other_addresses(name: str, keep: str, netns: str | None) -> None:
    out = await run_ip(["-j", "addr", "show", "dev", name], netns=netns)
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            cidr = f"{info.get('local')}/{info.get('prefixlen')}"
            if info.get("family") == "inet" and cidr != keep:
                await run_ip(["addr", "del", cidr, "dev", name], netns=netns)


async def delete_tap(name: str, *, netns: str | None = None) -> None:
    """Delete link ``name``; a missing link is fine (idempotent)."""
    code, _, err = await run_command(["ip", "link", "del", "dev", name], netns=netns)
    if code != 0 and await link_exists(name, netns=netns):
        raise NetworkError(f"cannot delete interface {name}: {err.strip()}")


async def list_links(prefix: str, *, netns: str | None = None) -> list[str]:
    """Names of the links starting with ``prefix`` (e.g. ``h<tag>``), sorted."""
    out = await run_ip(["-j", "link", "show"], netns=netns)
    names = [link.get("ifname", "") for link in json.loads(out or "[]")]
    return sorted(n for n in names if n.startswith(prefix))


async def enable_ip_forward(*, netns: str | None = None) -> None:
    """Set ``net.ipv4.ip_forward=1`` (sandbox traffic is routed through the host).

    Raises ``NetworkError`` when the sysctl cannot be written (not root?).
    """
    code, _, err = await run_command(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"], netns=netns)
    if code != 0:
        raise NetworkError(
            f"cannot enable IPv4 forwarding (sysctl net.ipv4.ip_forward=1): {err.strip()}; "
            "hutch must run as root"
        )
