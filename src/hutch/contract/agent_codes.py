"""The guest agent's wire error codes and the hutch error each one becomes, listed once.

The agent (``guest_agent/hutch_agent``, stdlib only, so it cannot import this) answers a
failed request with an ERROR frame ``{"code", "message"}``. The host side of the protocol
(``hutch.guest``) maps it with :func:`agent_error` only;
``tests/unit/test_contract.py`` reads every code the agent's source can send and fails
when one is missing here, or listed here but never sent.

A code not in :data:`AGENT_ERRORS` (``io_error``, ``internal``, or one a newer agent
added) is the agent failing: :class:`~hutch.errors.GuestError`, 502.
"""

from __future__ import annotations

from hutch.errors import Conflict, GuestError, HutchError, InvalidArgument, NotFound

__all__ = ["AGENT_ERRORS", "GUEST_FAILURES", "UNKNOWN_OPERATION", "agent_error"]

#: The agent got an op it does not implement: an image older than this host.
UNKNOWN_OPERATION = "unknown_operation"

AGENT_ERRORS: dict[str, type[HutchError]] = {
    "not_found": NotFound,
    "exists": Conflict,
    "not_empty": Conflict,
    #: A context whose Python process died; a process or terminal that already exited.
    "conflict": Conflict,
    "exited": Conflict,
    "invalid_argument": InvalidArgument,
    "not_a_directory": InvalidArgument,
    "is_a_directory": InvalidArgument,
    "command_not_found": InvalidArgument,
    "permission_denied": InvalidArgument,
    UNKNOWN_OPERATION: Conflict,
}
#: Codes the agent sends that mean it failed (not the request): GuestError.
GUEST_FAILURES = frozenset({"io_error", "internal"})

# Agents built before UNKNOWN_OPERATION existed answer an unknown op with
# invalid_argument and this message prefix; still running in sandboxes made from older
# images, so still recognised (and only here).
_LEGACY_UNKNOWN_OPERATION = "unknown operation "


def _rebuild_hint(feature: str) -> str:
    return (
        f"this sandbox's guest agent predates {feature}; create the sandbox from an "
        "image built by this hutch (`hutch image build --force`)"
    )


def agent_error(code: str, message: str, feature: str | None = None) -> HutchError:
    """The hutch error for an agent ERROR frame.

    ``feature`` names what the request was for (``"background processes"``): an agent
    that does not know the op then gets a Conflict saying to rebuild the image. Without
    it, an old agent's unknown-op answer keeps its own class (InvalidArgument).
    """
    legacy_unknown = code == "invalid_argument" and message.startswith(_LEGACY_UNKNOWN_OPERATION)
    if feature is not None and (code == UNKNOWN_OPERATION or legacy_unknown):
        return Conflict(_rebuild_hint(feature))
    if code == UNKNOWN_OPERATION:
        return Conflict(_rebuild_hint(f"this operation ({message})"))
    cls = AGENT_ERRORS.get(code)
    if cls is None:
        return GuestError(f"the guest agent failed ({code}): {message}")
    return cls(message)
