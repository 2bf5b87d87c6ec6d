"""Which host a create lands on: pure (the hosts and their use come in as values).

A host fits when it is ``up`` (not draining, not down), its lease is current, it
carries every label asked for, it has room for one more sandbox of the asked memory
(its ``memory_mib`` budget and ``max_sandboxes``), and, for a sandbox that starts from a
frozen VM state (:class:`Frozen`: a named snapshot, a pause it resumes from, its fork
parent), when it runs the same QEMU version and CPU model as the host that froze it (a
memory snapshot restores only into the build and CPU that took it) and can read its
files: any host once they are in the blob store, else only the host that froze it.
Among the fitting hosts, ``spread`` takes the one with the most memory free, ``pack`` the one
with the least; ties go to the fewest sandboxes, then the host id (deterministic).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hutch.contract.placement import Placement
from hutch.errors import Capacity, Conflict, InvalidArgument
from hutch.services.image_compat import compatible_image
from hutch.store.hosts import HostRow, HostUse

__all__ = [
    "Frozen",
    "choose_host",
    "keep_labels",
    "require_known",
    "require_labels",
    "shown_labels",
]


@dataclass(frozen=True)
class Frozen:
    """The frozen VM state a sandbox starts from, as placement needs it."""

    #: The host that froze it: a host taking the sandbox must run its QEMU version and
    #: CPU model (the state restores only into the build and CPU that saved it).
    host: str
    #: Its files are in the blob store, so any such host may fetch them; else only
    #: ``host`` holds them.
    anywhere: bool = False
    #: What it is, for the reasons a refusal gives ("the snapshot", "the pause").
    what: str = "the snapshot"
    #: The image it was frozen over, at ``digest``, and that copy's rootfs sha256
    #: (``image_compat.frozen_identity``), and the blob store's recorded upload of that
    #: digest (``builtin_blobs.uploaded_identity``): a host whose built-in image bytes
    #: differ cannot open it (None: nothing to compare).
    image: str = ""
    digest: str | None = None
    sha256: str | None = None
    uploaded: str | None = None


def require_known(hosts: Sequence[HostRow], placement: Placement) -> list[HostRow]:
    """The hosts ``placement`` selects, whatever their state or room now;
    InvalidArgument when no host of the cluster could ever meet it (an unknown host,
    labels no host carries, a pinned host without the labels asked for)."""
    known = {h.id: h for h in hosts}
    if placement.host is not None and placement.host not in known:
        raise InvalidArgument(
            f"placement.host {placement.host!r} is not a host of this cluster; hosts: "
            f"{', '.join(sorted(known)) or 'none'}"
        )
    candidates = [h for h in hosts if placement.host in (None, h.id)]
    wanted = dict(placement.labels)
    if not wanted:
        return candidates
    selected = [h for h in candidates if all(h.labels.get(k) == v for k, v in wanted.items())]
    if selected:
        return selected
    if placement.host is not None:
        raise InvalidArgument(
            f"host {placement.host} lacks the labels {shown_labels(wanted)} asked for "
            f"(its labels: {_labels(known[placement.host])})"
        )
    raise InvalidArgument(
        f"no host has the labels {shown_labels(wanted)}; the hosts' labels: "
        + "; ".join(f"{h.id}: {_labels(h)}" for h in hosts)
    )


def choose_host(
    hosts: Sequence[HostRow],
    use: Mapping[str, HostUse],
    placement: Placement,
    *,
    memory_mib: int,
    now: float,
    frozen: Frozen | None = None,
    exclude: str | None = None,
) -> HostRow:
    """The host for a sandbox of ``memory_mib``. InvalidArgument for a selector no host
    could ever meet (unknown host, labels no host has); Capacity when hosts match but
    none has room now (the message names each and why).

    ``frozen``: the state the sandbox restores from (its host's QEMU and CPU are the
    ones a host must run; only that host unless its files are in the blob store).
    ``exclude``: a host never picked (the one a sandbox moves off)."""
    known = {h.id: h for h in hosts}
    candidates = require_known(hosts, placement)
    reasons: list[str] = []
    fitting: list[tuple[HostRow, int]] = []
    source = known.get(frozen.host) if frozen is not None else None
    for h in candidates:
        held = use.get(h.id, HostUse())
        free = h.memory_mib - held.memory_mib
        if h.state != "up" or h.lease_until < now:
            reasons.append(f"{h.id} is {h.state if h.state != 'up' else 'not renewing its lease'}")
        elif h.id == exclude:
            reasons.append(f"{h.id} is the host it moves off")
        elif frozen is not None and not frozen.anywhere and h.id != frozen.host:
            reasons.append(f"{h.id} does not hold {frozen.what}'s files ({frozen.host} does)")
        elif frozen is not None and source is not None and (why := _restores(h, source)):
            reasons.append(f"{h.id} cannot restore {frozen.what}: {why}")
        elif frozen is not None and not compatible_image(
            h, frozen.image, frozen.digest, frozen.sha256, uploaded=frozen.uploaded
        ):
            reasons.append(
                f"{h.id} cannot restore {frozen.what}: its image {frozen.image} "
                f"({frozen.digest}) holds other bytes than the ones it was frozen over"
            )
        elif held.sandboxes + 1 > h.max_sandboxes:
            reasons.append(f"{h.id} holds {held.sandboxes}/{h.max_sandboxes} sandboxes")
        elif free < memory_mib:
            reasons.append(f"{h.id} has {free} MiB free, {memory_mib} MiB asked")
        else:
            fitting.append((h, free))
    if not fitting:
        raise Capacity("no host has room for this sandbox: " + "; ".join(reasons or ["no hosts"]))

    def key(item: tuple[HostRow, int]) -> tuple[int, int, str]:
        h, free = item
        count = use.get(h.id, HostUse()).sandboxes
        return (-free if placement.strategy == "spread" else free, count, h.id)

    return min(fitting, key=key)[0]


def _restores(h: HostRow, source: HostRow) -> str | None:
    """Why host ``h`` cannot restore a state ``source`` froze; None: it can."""
    if h.qemu_version != source.qemu_version:
        return f"it runs QEMU {h.qemu_version}, {source.id} (which froze it) {source.qemu_version}"
    if h.cpu_model != source.cpu_model:
        return f"its CPU is {h.cpu_model!r}, {source.id}'s is {source.cpu_model!r}"
    return None


def shown_labels(labels: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def keep_labels(
    sandbox_id: str, labels: Mapping[str, str], what: str, pick: Callable[[], HostRow]
) -> HostRow:
    """``pick()`` (a :func:`choose_host` for ``what``: a move or fork children of
    ``sandbox_id``, created with placement ``labels``), its refusal naming the labels
    that bind the sandbox: no host without them is ever picked instead. Capacity
    when hosts with the labels exist but none has room or is up now (a retry may
    succeed); Conflict when no host of the cluster carries them."""
    try:
        return pick()
    except (Capacity, InvalidArgument) as exc:
        if not labels:
            raise
        why = (
            f"{what} of {sandbox_id}: it was created with placement.labels "
            f"{shown_labels(labels)}, so it runs only on hosts carrying them, and none can take "
            f"it now: {exc.message}"
        )
        raise (Capacity(why) if isinstance(exc, Capacity) else Conflict(why)) from exc


def require_labels(
    sandbox_id: str, labels: Mapping[str, str], host: str, have: Mapping[str, str], what: str
) -> None:
    """Refuse (Conflict) ``what`` for ``sandbox_id`` on ``host`` when ``host`` (labels
    ``have``) lacks one of the sandbox's placement ``labels``."""
    missing = {k: v for k, v in labels.items() if have.get(k) != v}
    if missing:
        raise Conflict(
            f"{what} of {sandbox_id} refused on host {host}: the sandbox was created with "
            f"placement.labels {shown_labels(labels)} and this host lacks {shown_labels(missing)} "
            f"(its labels: {shown_labels(have) or '(none)'}); run it on a host carrying them"
        )


def _labels(h: HostRow) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(h.labels.items())) or "(none)"
