"""The status message: who is online, retained on each device's, gateway's and edge's status
topic (and the last will says "offline"). MQTT carries it; the edge's HTTP side reads it too.

A UTF-8 JSON object, ``{"state": "online"|"offline", ...fields, "ts": unix time}``; the bare
words ``online`` and ``offline`` are read as such.

Any client may publish a status (a retained one stays), so a reader bounds it before parsing:
at most :data:`MAX_STATUS_BYTES` and :data:`MAX_STATUS_DEPTH` levels of nesting, else it is
unreadable (``{}``), with one warning per kind of fault and then one at each doubling. Times in
it are checked on use (:func:`status_time`): finite, positive, not in the future.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Any

from ddnn import bounded_json

log = logging.getLogger(__name__)

STATES = ("online", "offline")
# A gateway's status lists its devices' (about 100 bytes each): room for several hundred.
MAX_STATUS_BYTES = 64 << 10
MAX_STATUS_DEPTH = 8  # a gateway's status is 3 deep ({"devices": {"cam0": {...}}})
FUTURE_TOLERANCE = 30.0  # seconds a time in a status may be ahead of this clock (NTP drift)
_faults: dict[str, int] = {}  # kind of fault -> statuses refused for it
_faults_lock = threading.Lock()


def status_payload(state: str, **info: Any) -> bytes:
    """The JSON body of a retained status message: ``{"state": "online"|"offline", ...}``."""
    return json.dumps({"state": state, **info, "ts": round(time.time(), 3)}).encode()


def status_fields(payload: bytes) -> dict[str, Any]:
    """The fields of a status body (``{"state": ...}`` for the bare word; ``{}`` if unreadable,
    too large or too deep)."""
    if len(payload) > MAX_STATUS_BYTES:
        return _refused("size", f"a status of {len(payload)} bytes (more than "
                                f"{MAX_STATUS_BYTES})")
    text = payload.decode("utf-8", "replace").strip()
    if text in STATES:
        return {"state": text}
    try:
        info = bounded_json.loads(text, MAX_STATUS_DEPTH)
    except bounded_json.JsonDepthError:
        return _refused("depth", f"a status nested more than {MAX_STATUS_DEPTH} levels deep")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def status_time(info: dict[str, Any], key: str, now: float | None = None) -> float | None:
    """``info[key]`` as a Unix time, if it is one that can be true: a finite positive number
    at most :data:`FUTURE_TOLERANCE` ahead of ``now`` (default: this clock); else None."""
    t = info.get(key)
    if not isinstance(t, int | float) or isinstance(t, bool):
        return None
    t = float(t)
    limit = (time.time() if now is None else now) + FUTURE_TOLERANCE
    if not (math.isfinite(t) and 0 < t <= limit):
        _refused("time", f"a status whose {key!r} is {t!r} (in the future, or no time)")
        return None
    return t


def _refused(kind: str, what: str) -> dict[str, Any]:
    """Count a status refused for ``kind``; a warning for the first and at each doubling."""
    with _faults_lock:
        n = _faults[kind] = _faults.get(kind, 0) + 1
    if n & (n - 1) == 0:
        log.warning("ignored %s (%d such so far)", what, n)
    return {}
