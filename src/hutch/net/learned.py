"""What the resolver taught one sandbox's learned allow sets, and until when (pure).

The nft sets ``a_<key>_dns``/``_dnsport`` (new connections, bound by the DNS TTL) and
``a_<key>_keep``/``_keepport`` (open flows across rule changes) are filled from DNS
answers. The kernel keeps only addresses and timeouts; two questions need more, and each
has its memory here (one of each per sandbox, kept by :mod:`hutch.net.learning`):

- :class:`LearnedElements` (issue 17.5): which elements the sets hold, until when. Every
  allowed answer used to cost one ``nft -f -`` (a process, ~10 ms); a guest resolving
  one allowed name in a loop had the host run nft hundreds of times a second. Elements
  are added with :data:`SLACK_S` seconds more than the answer's TTL, and an answer whose
  elements all stay for at least its TTL needs no nft at all: the guest can never cache
  an answer past its element (the invariant :mod:`hutch.net.dns` keeps). Skipping such
  answers also means a short TTL never cuts an element a longer one made.
- :class:`LearnedNames` (issue 16): which *name* each address was learned for, so that a
  rule change keeps what the new rules still allow. A policy swap flushes the learned
  sets; :meth:`LearnedNames.carry_over` refills them: addresses of names the new rules
  still allow come back with what is left of their element (new connections) and of
  :data:`~hutch.net.nft_sandbox.KEEP_S` (flows already open), on the ports the *new* rules give
  the name. Names the new rules do not allow are left out, so their open flows fail the
  new policy's check and are cut. After the swap, :meth:`LearnedElements.replaced`
  makes the elements memory exactly what the swap wrote.

Not thread-safe: both are used only from the data path's loop, under the sandbox's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from ipaddress import IPv4Address

from hutch.net.nft_sandbox import KEEP_S, LearnedAddress
from hutch.net.rules import EgressPolicy

__all__ = ["MAX_ELEMENTS", "MAX_REMEMBERED", "SLACK_S", "LearnedElements", "LearnedNames"]

#: Seconds an element outlives the TTL it was learned with: repeats of a name within
#: this window cost no nft transaction.
SLACK_S = 10

#: (name, address) pairs remembered per sandbox; the oldest are forgotten first (their
#: open flows would then be cut by the next rule change, never let through).
MAX_REMEMBERED = 4096

#: Elements tracked per sandbox before the expired ones are dropped.
MAX_ELEMENTS = 4096

#: An element of the sets new connections use: (address, port; None = any port).
Element = tuple[IPv4Address, int | None]


class LearnedElements:
    """The elements of one sandbox's ``a_<key>_dns``/``_dnsport`` sets and when each
    ends. Times are ``time.monotonic()`` seconds."""

    def __init__(self) -> None:
        self._ends: dict[Element, float] = {}

    def __len__(self) -> int:
        return len(self._ends)

    def stale(self, items: Iterable[Element], ttl: int, now: float) -> list[Element]:
        """The items the sets do not hold for at least ``ttl`` more seconds (in order)."""
        horizon = now + ttl
        return [item for item in items if self._ends.get(item, 0.0) < horizon]

    def added(self, items: Iterable[Element], timeout: int, now: float) -> None:
        """``items`` were just written with ``timeout`` seconds."""
        if len(self._ends) > MAX_ELEMENTS:  # very many names: drop what the kernel dropped
            for key in [k for k, end in self._ends.items() if end <= now]:
                del self._ends[key]
        for item in items:
            self._ends[item] = now + timeout

    def replaced(self, written: Iterable[LearnedAddress], now: float) -> None:
        """A policy swap flushed the sets and wrote exactly ``written`` (in this order: a
        later element with the same key wins, as in nft)."""
        self._ends = {}
        for item in written:
            if item.ttl is not None:
                self._ends[(item.address, item.port)] = now + max(1, int(item.ttl))


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
