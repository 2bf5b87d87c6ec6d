"""The meter, the event log and the price table (ARCHITECTURE.md, "Metering and
events")."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hutch.config.env import _ENV_OF
from hutch.errors import InvalidArgument

if TYPE_CHECKING:
    from hutch.config.settings import Settings


@dataclass(frozen=True)
class MeterSettings:
    """The meter, the event log and the price table (ARCHITECTURE.md, "Metering and
    events"). Prices are USD per unit-hour (egress: per GB); the defaults are the issue's.

    - ``heartbeat_s``: how often the meter writes that each running VM is alive; a VM
      found gone after a restart is billed to its last heartbeat, so at most this long
      of the time it ran under a live daemon goes unbilled.
    - ``events_retention_days`` / ``events_max``: the reaper drops events older than the
      one and all but the newest of the other.
    - ``egress_event_s``: a sandbox's denied egress is one ``egress.denied`` event per
      this many seconds at most (a summary: counts and the top destinations), whatever
      the packet rate. Egress bytes are written to the meter every ``heartbeat_s``.
    - ``events``: False turns the event log off (no traces, no audit trail); the meter
      is written all the same. ``bench/`` compares exec round trips with and without.
    """

    price_vcpu_hour: float = 0.03616363
    price_gib_hour: float = 0.01159025
    price_storage_gb_hour: float = 0.0001584
    price_egress_gb: float = 0.0
    heartbeat_s: float = 5.0
    egress_event_s: float = 60.0
    events_retention_days: float = 30.0
    events_max: int = 1_000_000
    events: bool = True


#: setting -> (bounds, what it is), for the messages of bad values.
METER_SETTINGS: dict[str, tuple[tuple[float, float], str]] = {
    "price_vcpu_hour": ((0.0, 1e6), "USD per vCPU-hour"),
    "price_gib_hour": ((0.0, 1e6), "USD per GiB-hour of memory"),
    "price_storage_gb_hour": ((0.0, 1e6), "USD per GB-hour of storage"),
    "price_egress_gb": ((0.0, 1e6), "USD per GB of egress"),
    "heartbeat_s": ((1.0, 60.0), "seconds between a running VM's meter heartbeats"),
    "egress_event_s": ((1.0, 3600.0), "seconds a sandbox's egress.denied event sums up"),
    "events_retention_days": ((0.01, 36500.0), "days events are kept"),
    "events_max": ((1000.0, 1e9), "events kept at most"),
}


def _meter_setting(source: str, key: str, value: Any) -> float | int:
    (lo, hi), what = METER_SETTINGS[key]
    env = _ENV_OF.get(key, key)
    shown = env if source == "environment" else f"{source}: {key}"
    try:
        number = float(str(value).strip())
    except ValueError:
        number = math.nan
    if isinstance(value, bool) or not lo <= number <= hi:
        raise InvalidArgument(f"{shown}={value!r} is not valid; accepted: {lo:g}-{hi:g} ({what})")
    return int(number) if key == "events_max" else number


def _meter_settings(s: Settings, values: dict[str, Any], source: str) -> Settings:
    meter: dict[str, Any] = {
        k: _meter_setting(source, k, values[k]) for k in METER_SETTINGS if k in values
    }
    if "events" in values:
        flag = str(values["events"]).strip().lower()
        if flag not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            shown = "HUTCH_EVENTS" if source == "environment" else f"{source}: events"
            raise InvalidArgument(f"{shown}={values['events']!r}; accepted: on/off, 1/0")
        meter["events"] = flag in ("1", "true", "yes", "on")
    if meter:
        s = replace(s, meter=replace(s.meter, **meter))
    return s
