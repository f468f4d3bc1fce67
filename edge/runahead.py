"""Views that run ahead of the other devices': held, so that they never open a frame alone.

A frame opens at its first view and waits a latency budget for the others
(:mod:`ddnn.edge.assembler`). A device whose views come long before the others' of the same
frame (a replay started ahead, a clock set ahead, a hostile device at 5000 fps) would open
frames alone; they would be answered from it alone and the other devices' views dropped as
late. So a view of a frame not yet open opens it only if its device is not running ahead:

* **with peers**: other devices whose views were taken in the last :attr:`RunAhead.active`
  seconds. The view runs ahead when its frame id leads the upper median of those peers' newest
  frame ids by more than :data:`BURST` frames. The median of the *other* devices, so one device
  that runs ahead never sets the reference, and a flagged one is no peer. Holding costs nothing
  where the peers come soon: the view joins the frame they open.
* **alone** (no peer reports, but other devices are expected): its frame ids may advance no
  faster than ``max_fps`` per second of *capture time* (a token bucket of :data:`BURST` frames).
  A camera numbers frames by capture time, a replay paces them; a device alone at 5000 fps,
  or replaying as fast as it can, is not trusted to open frames until peers report. Spooled
  frames sent in a burst after an outage keep their capture times, so their pace stays theirs.

A held view waits (at most :data:`HOLD` per device) for another device to open its frame. It
joins the frame if it was held less than the budget: the frame's clock starts at the first view
that was not ahead, and nothing is lost. Held longer, or pushed out by newer ones, it *ran
ahead*: dropped, and counted against its device (:class:`~ddnn.edge.conduct.Conduct`), which is
flagged when most of its recent views ran ahead. A device alone whose views are only ever held
(the other devices expected but silent) makes those devices miss a wait, as a frame that
expires would, so they stop being expected and the device is alone no longer.

Not thread-safe: the assembler calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ddnn.edge.pipeline import Scores

MAX_FPS = 240.0  # frames per second of capture time no camera exceeds (--max-fps)
BURST = 8.0  # frames a device may run ahead of that pace at once (capture jitter, skipped slots)
HOLD = 1024  # views held per device at most; the oldest is dropped past it (it ran ahead)
ACTIVE = 1.0  # seconds: a device whose views were taken this recently is a peer (at least)


@dataclass
class Held:
    """A view held because its device ran ahead when it came."""

    frame: int
    scores: Scores | None  # its scores (a tuple of floats or an array), or None: absent
    captured: float
    arrived: float  # monotonic time it came
    features: np.ndarray | None = None  # its features, pushed right after its scores (push)
    skipped: bool = False  # no scores because its device skipped the frame (it fell behind)


@dataclass
class Position:
    """Where one device is: its newest frame taken, and its pace."""

    newest: int | None = None  # highest frame id of its views taken (that opened or joined one)
    at: float = float("-inf")  # monotonic time of its last view taken
    tokens: float = 0.0  # frames it may advance alone now (the pace bucket)
    capture: float | None = None  # capture time of its last view, for the bucket

    def refill(self, captured: float, max_fps: float) -> None:
        if self.capture is not None and captured > self.capture:
            self.tokens = min(BURST, self.tokens + (captured - self.capture) * max_fps)
        if self.capture is None or captured > self.capture:
            self.capture = captured


class RunAhead:
    """Judges the views of frames not yet open, and holds those that run ahead."""

    def __init__(self, views: int, max_wait: float, max_fps: float = MAX_FPS):
        self.max_wait, self.max_fps = max_wait, max_fps
        self.active = max(ACTIVE, 2 * max_wait)
        self.positions = [Position() for _ in range(views)]
        self.held: list[dict[int, Held]] = [{} for _ in range(views)]  # arrival order
        self.holding = 0  # views held in all (opening a frame looks for its held views only then)

    def ahead(self, view: int, frame: int, captured: float, now: float,
              expected: Sequence[int]) -> bool:
        """Whether a view of a frame not yet open runs ahead (see the module's doc);
        ``expected``: the devices the frames wait for now."""
        p = self.positions[view]
        p.refill(captured, self.max_fps)
        others = [u for u in expected if u != view]
        peers = self.peers(others, now)
        if peers:
            newest = sorted(n for u in peers if (n := self.positions[u].newest) is not None)
            return frame - newest[len(newest) // 2] > BURST  # (the upper median)
        if not others or p.newest is None:
            return False  # nobody to run ahead of, or its first view: nothing known of it yet
        return frame - p.newest > p.tokens

    def peers(self, views: Iterable[int], now: float) -> list[int]:
        """Of ``views``, those whose views were taken recently."""
        return [u for u in views if now - self.positions[u].at <= self.active
                and self.positions[u].newest is not None]

    def taken(self, view: int, frame: int, now: float) -> None:
        """A view of ``view`` opened or joined a frame: the device is there now."""
        p = self.positions[view]
        if p.newest is None or frame > p.newest:
            if p.newest is not None:
                p.tokens = max(p.tokens - (frame - p.newest), 0.0)
            p.newest = frame
        p.at = now

    def hold(self, view: int, frame: int, scores: Scores | None, captured: float,
             now: float, skipped: bool = False) -> list[Held]:
        """Hold a view; returns those pushed out (its device's oldest, past :data:`HOLD`)."""
        held = self.held[view]
        if frame in held:
            return []
        held[frame] = Held(frame, scores, captured, now, skipped=skipped)
        self.holding += 1
        out = []
        while len(held) > HOLD:
            out.append(held.pop(next(iter(held))))
            self.holding -= 1
        return out

    def claim(self, frame: int) -> list[tuple[int, Held]]:
        """The views held for ``frame``, now that another device opened it (no longer held)."""
        if not self.holding:
            return []
        out = []
        for view, held in enumerate(self.held):
            h = held.pop(frame, None)
            if h is not None:
                out.append((view, h))
        self.holding -= len(out)
        return out

    def aged(self, now: float) -> list[tuple[int, Held]]:
        """Views held longer than the budget (no longer held): they ran ahead."""
        if not self.holding:
            return []
        out = []
        for view, held in enumerate(self.held):
            while held:
                h = next(iter(held.values()))
                if now - h.arrived <= self.max_wait:
                    break
                out.append((view, held.pop(h.frame)))
        self.holding -= len(out)
        return out

    def hold_features(self, view: int, frame: int, features: np.ndarray) -> bool:
        """Keep the features of a held view with it (pushed after its scores); False: its
        view is not held."""
        h = self.held[view].get(frame)
        if h is None:
            return False
        if h.features is None:
            h.features = features
        return True

    def is_held(self, view: int, frame: int) -> bool:
        return frame in self.held[view]
