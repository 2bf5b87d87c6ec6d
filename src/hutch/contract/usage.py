"""One row of ``GET /v1/usage``, declared once: the daemon fills it
(:mod:`hutch.services.metering`), the REST schema is this very class (pydantic reads a
dataclass and its attribute docstrings: ``api/meter_schemas.py``), and the SDK returns it
(``hutch.sdk.UsageRow``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

__all__ = ["UsageRow"]


@dataclass(frozen=True)
class UsageRow:
    """One group's quantities and cost over the window. Times are per second: a sandbox
    running 90 s with 2 vCPUs is ``vcpu_seconds`` 180."""

    # Read by pydantic only (no import of it here): the docstrings below document the
    # fields in openapi.json.
    __pydantic_config__: ClassVar[dict[str, Any]] = {"use_attribute_docstrings": True}

    key: str
    """The sandbox or snapshot id (image:<project>/<name> for an image), the UTC day
    (YYYY-MM-DD), or the project, as group_by asks; 'total' for the sum."""
    vcpu_seconds: float
    memory_gib_seconds: float
    """Guest RAM while the VM runs."""
    paused_memory_gib_seconds: float
    """Memory state held paused (memory mode)."""
    disk_gb_hours: float
    snapshot_gb_hours: float
    image_gb_hours: float
    egress_allowed_bytes: int
    """Bytes the sandbox sent out: forwarded from its tap or relayed by the egress proxy."""
    egress_denied_bytes: int
    """Bytes of its packets the egress rules dropped."""
    cost_usd: float

    @classmethod
    def from_dict(cls, d: Any) -> UsageRow:
        """A row as the API answers it; ``ValueError`` naming what is wrong."""
        try:
            values: dict[str, Any] = {}
            for f in fields(cls):
                raw = d[f.name]
                if f.type == "str":
                    values[f.name] = str(raw)
                elif f.type == "int":
                    values[f.name] = int(raw)
                else:
                    values[f.name] = float(raw)
            return cls(**values)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed usage row: {d!r}") from exc
