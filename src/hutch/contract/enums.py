"""The closed sets of words the API takes and answers with."""

from __future__ import annotations

import enum

__all__ = ["DEFAULT_NETWORK_MODE", "DEFAULT_PAUSE_MODE", "NetworkMode", "PauseMode"]


class NetworkMode(enum.StrEnum):
    """``default``: a tap, an address and NAT, filtered by egress rules.
    ``none``: a NIC that leads nowhere."""

    DEFAULT = "default"
    NONE = "none"


class PauseMode(enum.StrEnum):
    #: CPU, memory and device state saved; processes continue after resume.
    MEMORY = "memory"
    #: Only the disk kept; the guest boots again on resume.
    DISK = "disk"


#: What a create and a pause use when the request names no mode.
DEFAULT_NETWORK_MODE = NetworkMode.DEFAULT
DEFAULT_PAUSE_MODE = PauseMode.MEMORY
