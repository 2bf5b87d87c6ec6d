"""Reading the API's JSON into the SDK's value objects: typed field access that names
what was wrong when a daemon answers something this SDK cannot read."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from hutch.sdk._errors import ProtocolError

__all__ = ["iso", "maybe", "moment", "need", "strings"]


def need(obj: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``obj[key]``, which must be of ``kind``; ProtocolError otherwise."""
    if not isinstance(obj, dict):
        raise ProtocolError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    value = obj.get(key)
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # JSON true is not a number, though Python's bool subclasses int.
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(
            f"{what}: field {key!r} is {value!r}; the daemon may be a "
            "different version than this SDK"
        )
    return value


def maybe(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """Like :func:`need`, but a missing or null field is None."""
    if obj.get(key) is None:
        return None
    return need(obj, key, kind, what)


def moment(obj: dict[str, Any], key: str, what: str) -> datetime | None:
    """An ISO 8601 time field (None when absent)."""
    raw = maybe(obj, key, str, what)
    if raw is None:
        return None
    try:
        return datetime.fromisoformat(raw)
    except ValueError as exc:
        raise ProtocolError(f"{what}: field {key!r}={raw!r} is not an ISO 8601 time") from exc


def strings(obj: Any, key: str, what: str) -> list[str]:
    """A list-of-strings field."""
    items = need(obj, key, list, what)
    if not all(isinstance(item, str) for item in items):
        raise ProtocolError(f"{what}: field {key!r} must be a list of strings, got {items!r}")
    return list(items)


def iso(value: datetime | None) -> str | None:
    """The API's form of a time (``...Z`` for UTC), for ``to_dict()``."""
    if value is None:
        return None
    text = value.isoformat(timespec="milliseconds")
    return text[:-6] + "Z" if text.endswith("+00:00") else text
