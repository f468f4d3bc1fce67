"""The devices a gateway speaks for, as the edge sees them through it.

Which devices it forwards (those ``--devices`` lists, else the first :data:`MAX_DEVICES` seen),
what of each one's status goes up (the fields the edge reads), and which views the edge pulled
for a frame: a features (or details) group waits for the online devices of those views only,
a scores group for every online device.
"""

from __future__ import annotations

import threading

from ddnn import envelope as env
from ddnn.device.gateway.coalescer import Key
from ddnn.device.gateway.settings import MAX_DEVICES
from ddnn.envelope import DecodeError, MessageType
from ddnn.status import status_fields, status_time

# What of a device's status goes up (the edge reads these; the rest stays on the site).
STATUS_FIELDS = ("state", "view", "model", "mode", "since")
MAX_MASK = 32  # bytes of a pull's view mask the gateway keeps (256 views)


class SiteRoster:
    """The site's devices and the edge's pulls, bounded (``max_pulls`` frames remembered)."""

    def __init__(self, devices: tuple[str, ...] = (), max_pulls: int = 10_000):
        self.listed, self.max_pulls = devices, max_pulls
        self.statuses: dict[str, dict] = {}  # device -> the status fields it sent up
        self.pulled: dict[int, bytes] = {}  # frame -> the views' mask of the edge's pull
        self._lock = threading.Lock()  # pulls arrive from the edge, groups end on the site

    def forwards(self, device: str) -> bool:
        """A device of this gateway: listed, or (without a list) one of the first seen."""
        if self.listed:
            return device in self.listed
        return device in self.statuses or len(self.statuses) < MAX_DEVICES

    def status(self, device: str, payload: bytes) -> bool:
        """Take ``device``'s status message; True when what goes up of it changed."""
        info = status_fields(payload)
        if info.get("state") not in ("online", "offline"):
            return False
        fields = {k: info[k] for k in STATUS_FIELDS if k in info}
        if "since" in fields and status_time(info, "since") is None:
            del fields["since"]  # not a time that can be true: the edge is not told it
        if self.statuses.get(device) == fields:
            return False  # nothing new for the edge (retained statuses come again)
        self.statuses[device] = fields
        return True

    def remember_pull(self, payload: bytes) -> None:
        """Which views the edge pulled for a frame: its features' (or details') group waits
        for them."""
        try:
            e = env.decode(payload)
        except DecodeError:
            return  # the devices drop and count it
        # (a detail pull names its senders the same way; their details travel as features)
        if (e.kind not in (MessageType.REQUEST, MessageType.DETAIL_REQUEST)
                or e.codec != "binary" or len(e.payload) > MAX_MASK):
            return
        with self._lock:
            self.pulled[e.frame] = e.payload
            while len(self.pulled) > self.max_pulls:
                self.pulled.pop(next(iter(self.pulled)))

    def expected(self, key: Key) -> set[str]:
        """The devices a group waits for: the online ones; for features, those pulled."""
        kind, frame = key
        online = {d for d, f in self.statuses.items() if f.get("state") == "online"}
        if kind == "scores":
            return online
        with self._lock:
            mask = self.pulled.get(frame)
        if mask is None:
            return set()  # a pull we did not see (or push mode): wait for the window
        return {d for d in online if _pulled(mask, self.statuses[d].get("view"))}

    def sent(self, key: Key) -> None:
        """A group went up: a features group's pull is answered."""
        if key[0] == "features":
            with self._lock:
                self.pulled.pop(key[1], None)


def _pulled(mask: bytes, view) -> bool:
    """Whether the request's packed view mask (binary codec: MSB first) holds ``view``."""
    if not isinstance(view, int) or isinstance(view, bool) or not 0 <= view < 8 * len(mask):
        return False
    return bool(mask[view // 8] >> (7 - view % 8) & 1)
