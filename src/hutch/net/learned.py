"""Which DNS-learned addresses the nft sets already hold long enough.

Every allowed answer used to cost one ``nft -f -`` (a process, ~10 ms) to put its
addresses into the sandbox's allow set. A guest resolving the same allowed name in a
loop would have the host run nft hundreds of times a second. Instead an element is added
with :data:`SLACK_S` seconds more than the answer's TTL, and an answer whose addresses
are all still in the set for at least its TTL needs no nft at all: the guest can never
cache an answer past the element (the invariant :mod:`hutch.net.dns` keeps).

A policy change flushes the sets; :meth:`LearnedCache.invalidate` is called before the
flush, and a learning that started before it is not remembered (the generation moved),
so the cache never claims an element the flush removed.

Used from the data path's thread (``fresh``/``remember``) and the API's (``invalidate``,
``forget``): each is a few dict operations under a lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from ipaddress import IPv4Address

__all__ = ["SLACK_S", "LearnedCache"]

#: Seconds an element outlives the TTL it was learned with: repeats of a name within
#: this window cost no nft transaction.
SLACK_S = 10

_Key = tuple[IPv4Address, int | None]


class LearnedCache:
    """See the module docstring. ``clock`` is monotonic seconds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        # sandbox id -> (generation, {(address, port): monotonic expiry of the element})
        self._sets: dict[str, tuple[int, dict[_Key, float]]] = {}

    def generation(self, sandbox_id: str) -> int:
        """The sandbox's current generation (read before learning, passed to remember)."""
        with self._lock:
            return self._sets.setdefault(sandbox_id, (0, {}))[0]

    def fresh(self, sandbox_id: str, items: Iterable[_Key], ttl: int) -> list[_Key]:
        """The items that are not in the set for at least ``ttl`` more seconds."""
        horizon = self._clock() + ttl
        with self._lock:
            known = self._sets.get(sandbox_id, (0, {}))[1]
            return [item for item in items if known.get(item, 0.0) < horizon]

    def remember(
        self, sandbox_id: str, generation: int, items: Iterable[_Key], timeout: int
    ) -> None:
        """``items`` were added with ``timeout`` seconds, by a learning that started at
        ``generation`` (ignored if the sets were flushed since)."""
        expiry = self._clock() + timeout
        with self._lock:
            entry = self._sets.get(sandbox_id)
            if entry is None or entry[0] != generation:
                return  # forgotten (deleted) or flushed since the learning started
            known = entry[1]
            now = self._clock()
            if len(known) > 4096:  # a sandbox resolving very many names: drop the expired
                for key in [k for k, t in known.items() if t <= now]:
                    del known[key]
            for item in items:
                known[item] = expiry

    def invalidate(self, sandbox_id: str) -> None:
        """The sandbox's learned sets are about to be flushed (a policy change)."""
        with self._lock:
            gen = self._sets.get(sandbox_id, (0, {}))[0]
            self._sets[sandbox_id] = (gen + 1, {})

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._sets.pop(sandbox_id, None)
