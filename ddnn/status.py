"""The status message: who is online, retained on each device's, gateway's and edge's status
topic (and the last will says "offline"). MQTT carries it; the edge's HTTP side reads it too.

A UTF-8 JSON object, ``{"state": "online"|"offline", ...fields, "ts": unix time}``; the bare
words ``online`` and ``offline`` are read as such.
"""

from __future__ import annotations

import json
import time
from typing import Any

STATES = ("online", "offline")


def status_payload(state: str, **info: Any) -> bytes:
    """The JSON body of a retained status message: ``{"state": "online"|"offline", ...}``."""
    return json.dumps({"state": state, **info, "ts": round(time.time(), 3)}).encode()


def status_fields(payload: bytes) -> dict[str, Any]:
    """The fields of a status body (``{"state": ...}`` for the bare word; ``{}`` if unreadable)."""
    text = payload.decode("utf-8", "replace").strip()
    if text in STATES:
        return {"state": text}
    try:
        info = json.loads(text)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}
