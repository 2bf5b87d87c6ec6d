"""What the resolver taught one sandbox's allow sets, remembered so a rule change keeps
what the new rules still allow (pure; the manager owns one per sandbox).

nft forgets which name an address was learned for; a policy swap flushes the learned
sets. :class:`LearnedNames` keeps (name, address) -> (end of its DNS TTL, end of its
keep time) so that :meth:`LearnedNames.carry_over` can refill the new policy's sets:
addresses of names the new rules still allow come back with what is left of their TTL
(new connections) and of :data:`~hutch.net.nft.KEEP_S` (flows already open), on the
ports the *new* rules give the name. Names the new rules do not allow are dropped, so
their open flows fail the new policy's check and are cut.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from ipaddress import IPv4Address

from hutch.net.nft import KEEP_S, LearnedAddress
from hutch.net.rules import EgressPolicy

__all__ = ["MAX_REMEMBERED", "LearnedNames"]

#: (name, address) pairs remembered per sandbox; the oldest are forgotten first (their
#: open flows would then be cut by the next rule change, never let through).
MAX_REMEMBERED = 4096


class LearnedNames:
    """(name, address) pairs learned for one sandbox. Times are ``time.monotonic()``."""

    def __init__(self, limit: int = MAX_REMEMBERED) -> None:
        self._limit = limit
        self._seen: dict[tuple[str, IPv4Address], tuple[float, float]] = {}

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, name: str, addrs: Iterable[IPv4Address], ttl: int, now: float) -> None:
        """``name`` resolved to ``addrs`` (learned for ``ttl`` seconds) at ``now``."""
        for addr in addrs:
            key = (name, addr)
            self._seen.pop(key, None)  # re-learned: newest again
            self._seen[key] = (now + ttl, now + KEEP_S)
        while len(self._seen) > self._limit:
            del self._seen[next(iter(self._seen))]

    def carry_over(
        self,
        policy: EgressPolicy,
        now: float,
        forbidden: Callable[[IPv4Address], object] = lambda _addr: None,
    ) -> list[LearnedAddress]:
        """The learned addresses ``policy`` still allows, for its sets. Entries past
        their keep time (or now ``forbidden``) are dropped from memory as well."""
        out: list[LearnedAddress] = []
        for key, (dns_end, keep_end) in list(self._seen.items()):
            name, addr = key
            if keep_end <= now or forbidden(addr):
                del self._seen[key]
                continue
            if policy.mode != "rules" or policy.name_allowed_any_port(name) is None:
                continue
            ttl_left = int(dns_end - now)
            ttl = ttl_left if ttl_left >= 1 else None
            keep = max(1, int(keep_end - now))
            out += [LearnedAddress(addr, port, ttl, keep) for port in policy.name_ports(name)]
        return out
