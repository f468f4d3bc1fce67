"""The latency planner (``--latency-slo``): the operating point the edge runs, chosen from the
bundle's operating curve by what its paths cost now.

The bundle's calibration stored the operating curve on held-out data
(:mod:`ddnn.operating_curve`: accuracy and exit shares per escalation level and thresholds).
Every :data:`REPLAN_EVERY` seconds the planner predicts each point's latency percentile from
the costs measured now (:class:`~ddnn.edge.latency.PathCosts`) and picks:

* while the point in force is predicted to meet the objective, it stays, unless a more
  accurate one is predicted under :data:`MARGIN` of the objective and the point in force has
  been held :data:`HOLD` seconds (hysteresis: a point is not left for a better one on a
  prediction just under the line, nor a moment after it was taken);
* a climb to a more accurate point that misses soon after (within :data:`HOLD_MAX` seconds)
  bars that point, and any as accurate, for a back-off that doubles with each such miss, up
  to :data:`BACKOFF_MAX`; a climbed point held :data:`HOLD_MAX` seconds puts the back-off
  back to :data:`HOLD`. The costs measured while few frames go up are lone calls: they miss
  the queueing that a point sending most frames up causes, so without this back-off the
  planner would try that point again every few seconds;
* once it is predicted to miss, the most accurate point predicted to meet it, at once; with
  none, the fastest, and health warns that the objective cannot be met.

No point is less accurate than the local exit alone (the curve's point that answers every frame
there), and only points at the bundle's escalation level send frames up (the level decides the
cloud model and the detail pulls). Under an objective the planner owns the pull deadlines:
what the objective leaves once the local path's percentile is spent. A frame the local exit
answered is now and then sent on up anyway, as a probe (answered already, like an audit,
:mod:`ddnn.edge.audit`), so that the pull and the cloud are measured while the point in force
keeps frames away from them, and the planner sees them recover. Where the drift monitor adapts
the thresholds (``--audit-rate``), the objective wins: the planner's thresholds are put back,
and health warns that the accuracy budget is not held.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from ddnn.bundle import Manifest
from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.frame import Frame
from ddnn.edge.latency import PathCosts
from ddnn.edge.pipeline import ExitPipeline
from ddnn.edge.settings import LatencyObjective
from ddnn.errors import ConfigError
from ddnn.operating_curve import OperatingPoint, table_points
from ddnn.plumbing.lifecycle import Worker

log = logging.getLogger(__name__)

REPLAN_EVERY = 0.5  # seconds between two plans
HOLD = 2.0  # seconds a point is held before a more accurate one may replace it
HOLD_MAX = 8.0  # seconds: a climb that missed within this long backs off; one held this long
# is safe
BACKOFF_MAX = 16.0  # seconds a point that missed after a climb is barred, at most
MARGIN = 0.8  # a more accurate point must be predicted under this share of the objective
PROBE_SHARE = 0.05  # of the frames the local exit answers, the share sent up as probes
PROBE_EVERY = 0.25  # seconds: and at least one this often, however few frames come
EDGE_SHARE = 0.1  # of the objective, kept for the edge exit's compute after a pull
MIN_PULL = 0.005  # seconds: the shortest pull deadline the planner sets
HELD = 4096  # probed frames waiting for their features, at most


@dataclass(frozen=True)
class Plan:
    """The point in force and what the planner knows of it (seconds; None: not measured)."""

    point: OperatingPoint
    predicted: float | None  # its latency percentile, predicted from the costs now
    measured: float | None  # the percentile of every answer's latency in the last seconds
    met: bool  # the point is predicted to meet the objective (or nothing is known yet)
    pull_deadline: float  # seconds a frame waits for pulled features (and details)

    def summary(self) -> dict[str, float]:
        p = self.point
        return {"level": p.level, "local": p.local, "edge": p.edge, "accuracy": p.accuracy}


def curve_points(m: Manifest) -> list[OperatingPoint]:
    """The points the planner may run for bundle ``m``: its curve's, at its escalation level
    or sending nothing up, none less accurate than its local exit alone."""
    table = m.calibration.get("curve")
    if not table:
        raise ConfigError(f"bundle {m.name}:{m.version} stores no operating curve (trained by "
                          "an older ddnn): --latency-slo plans over it; retrain or re-calibrate")
    points = table_points(table)
    local_only = [p.accuracy for p in points if p.exit_fraction["local"] >= 1 - 1e-9]
    floor = max(local_only, default=-math.inf)
    return [p for p in points if p.accuracy >= floor - 1e-9
            and (p.level == m.escalation_level or p.exit_fraction["cloud"] <= 0)]


def shares(p: OperatingPoint) -> dict[str, float]:
    return {k: p.exit_fraction[k] for k in ("local", "edge", "cloud")}


class LatencyPlanner:
    """Plans the point ``pipeline()`` (the pipeline new frames run on) runs under
    ``objective``, from ``costs``; ``deadlines(seconds)`` sets the pull deadlines; ``drift()``
    is the drift monitor's status (None: off). Reports ``on_latency_plan`` and
    ``on_thresholds`` through ``events``."""

    def __init__(self, objective: LatencyObjective, costs: PathCosts,
                 pipeline: Callable[[], ExitPipeline], *,
                 deadlines: Callable[[float], None], pull_deadline: float,
                 drift: Callable[[], Mapping | None] = lambda: None,
                 events: EdgeEvents = NO_EVENTS, seed: int | None = None):
        if objective.slo is None:
            raise ConfigError("the latency planner needs an objective (--latency-slo)")
        self.slo, self.q = objective.slo, objective.quantile
        self.costs, self._pipeline, self.events = costs, pipeline, events
        self._deadlines, self._drift = deadlines, drift
        self.configured_pull = pull_deadline
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._probed: dict[int, float] = {}
        self._last_probe = -math.inf
        self.replans = 0
        self.backoff = HOLD  # seconds the next point that misses after a climb is barred
        self._climbed = -math.inf  # when the planner last moved to a more accurate point
        self._barred = (math.inf, -math.inf)  # points this accurate are barred until then
        self.drift_overruled = False
        self.plan: Plan | None = None
        self._start(pipeline().manifest, time.monotonic())
        self._stop = threading.Event()
        self.worker = Worker("edge-latency-planner", self._loop, stop=self._stop.set)

    def _start(self, m: Manifest, now: float) -> None:
        """Plan afresh for bundle ``m``, from its configured point (at the start, and after an
        update)."""
        self.version, self.points = m.version, curve_points(m)
        policy = self._pipeline().policy
        configured = (policy.threshold("local"), policy.threshold("edge"))
        self.point = next((p for p in self.points if (p.local, p.edge) == configured),
                          self._configured(m, configured))
        self.since = now

    @staticmethod
    def _configured(m: Manifest, thresholds: tuple[float, float]) -> OperatingPoint:
        """The configured thresholds as a point, with what calibration says of them."""
        c = m.calibration
        fractions = c.get("exit_fraction") or {"local": 0.0, "edge": 0.0, "cloud": 1.0}
        return OperatingPoint(level=m.escalation_level, local=thresholds[0], edge=thresholds[1],
                              accuracy=float(c.get("accuracy", 0.0)),
                              bytes_per_frame=float(c.get("bytes_per_frame", 0.0)),
                              exit_fraction={k: float(fractions.get(k, 0.0))
                                             for k in ("local", "edge", "cloud")})

    # --- planning -----------------------------------------------------------------------

    def tick(self, now: float | None = None) -> Plan:
        """Plan once, and put the plan in force."""
        now = time.monotonic() if now is None else now
        p = self._pipeline()
        if p.manifest.version != self.version:
            self._start(p.manifest, now)  # another bundle: another curve
        model = "escalated" if p.manifest.escalation_level and p.manifest.escalated else "cloud"
        paths = self.costs.paths(model, now)
        predicted = {id(c): self.costs.predict(shares(c), self.q, paths) for c in self.points}
        current = self.costs.predict(shares(self.point), self.q, paths)
        point, met = self._choose(current, predicted, now)
        if point is not self.point:
            self._back_off(point, now)
            self._switch(point, now, predicted.get(id(point)))
            current = predicted.get(id(point))
        elif self.since == self._climbed and now - self.since >= HOLD_MAX:
            self.backoff = HOLD  # the point climbed to held: climbing is safe again
        local = paths["local"]
        local_q = float(np.quantile(local, self.q)) if local is not None else 0.0
        pull = min(max(self.slo * (1 - EDGE_SHARE) - local_q, MIN_PULL), self.configured_pull)
        self._deadlines(pull)
        self._enforce(p)
        self.plan = Plan(self.point, current, self.costs.measured.quantile(self.q, now), met,
                         pull)
        self.events.on_latency_plan(self.plan.summary(), self.slo, self.plan.predicted,
                                    self.plan.measured, met)
        return self.plan

    def _choose(self, current: float | None, predicted: Mapping[int, float | None],
                now: float) -> tuple[OperatingPoint, bool]:
        """The point to run and whether it is predicted to meet the objective."""
        known = {id(c): (c, t) for c in self.points if (t := predicted[id(c)]) is not None}
        meeting = [(c, t) for c, t in known.values() if t <= self.slo]
        if current is None:
            return self.point, True  # nothing known of its paths yet: keep it
        if current > self.slo:
            if meeting:
                return max(meeting, key=lambda ct: (ct[0].accuracy, -ct[1]))[0], True
            fastest = min(known.values(), key=lambda ct: (ct[1], -ct[0].accuracy),
                          default=(self.point, current))
            return fastest[0], False
        barred, until = self._barred
        better = [(c, t) for c, t in meeting
                  if c.accuracy > self.point.accuracy and t <= MARGIN * self.slo
                  and (c.accuracy < barred or now >= until)]
        if better and now - self.since >= HOLD:
            return max(better, key=lambda ct: (ct[0].accuracy, -ct[1]))[0], True
        return self.point, True

    def _back_off(self, point: OperatingPoint, now: float) -> None:
        """Before moving to ``point``: a climb is noted; a move down soon after one bars the
        point climbed to (it missed) for the back-off, which doubles."""
        if point.accuracy > self.point.accuracy:
            self._climbed = now
        elif now - self._climbed < HOLD_MAX:
            self._barred = (self.point.accuracy, now + self.backoff)
            log.info("latency objective: the point climbed to missed; points as accurate wait "
                     "%.0f s", self.backoff)
            self.backoff = min(2 * self.backoff, BACKOFF_MAX)

    def _switch(self, point: OperatingPoint, now: float, predicted: float | None) -> None:
        log.info("latency objective %.0f ms at p%g: operating point level %d, thresholds local "
                 "%.3f, edge %.3f (held-out accuracy %.3f, cloud share %.2f; predicted %s)",
                 1000 * self.slo, 100 * self.q, point.level, point.local, point.edge,
                 point.accuracy, point.exit_fraction["cloud"],
                 "unknown" if predicted is None else f"{1000 * predicted:.0f} ms")
        self.point, self.since = point, now
        self.replans += 1

    def _enforce(self, p: ExitPipeline) -> None:
        """The planner's thresholds on ``p``; the objective wins over the drift monitor."""
        want = {"local": self.point.local, "edge": self.point.edge}
        drift = self._drift()
        adapted = drift.get("thresholds") if drift and drift.get("adapt") else None
        self.drift_overruled = adapted is not None and any(
            abs(float(adapted[k]) - v) > 1e-9 for k, v in want.items())
        if any(abs(p.policy.threshold(k) - v) > 1e-12 for k, v in want.items()):
            p.policy = p.policy.with_overrides(**want)
            self.events.on_thresholds(want)

    def _loop(self) -> None:
        while not self._stop.wait(REPLAN_EVERY):
            try:
                self.tick()
            except Exception:  # a bug must not end planning silently: the next tick retries
                log.exception("latency planning failed")

    # --- probes (the frame path) --------------------------------------------------------

    def probe(self, f: Frame) -> bool:
        """A frame answered at the local exit: True when it goes on up anyway, as a probe
        (while the point in force sends few frames up)."""
        if self.point.exit_fraction["cloud"] >= PROBE_SHARE:
            return False
        now = time.monotonic()
        with self._lock:
            if self._rng.random() >= PROBE_SHARE and now - self._last_probe < PROBE_EVERY:
                return False
            self._last_probe = now
            if len(self._probed) >= HELD:  # frames that never came back: forget the oldest
                self._probed.pop(next(iter(self._probed)))
            self._probed[f.id] = PROBE_SHARE
        return True

    def probed(self, f: Frame) -> float:
        """At the edge exit: the share of probes when ``f`` is one (it goes up answered)."""
        with self._lock:
            return self._probed.pop(f.id, 0.0)

    # --- where things stand -----------------------------------------------------------------

    def reason(self) -> str | None:
        """Why the objective is not held, in a sentence (None while it is)."""
        plan = self.plan
        if plan is None:
            return None
        slo = f"{1000 * self.slo:.0f} ms at p{100 * self.q:g}"
        if not plan.met:
            return (f"latency objective {slo} cannot be met: the fastest operating point is "
                    f"predicted at {_ms(plan.predicted)} with the costs measured now")
        if plan.measured is not None and plan.measured > self.slo:
            return (f"latency objective {slo} missed over the last seconds: measured "
                    f"{_ms(plan.measured)} (predicted {_ms(plan.predicted)} for the point now "
                    "in force)")
        return None

    def drift_reason(self) -> str | None:
        """Why the drift monitor's thresholds are not in force (None while they are)."""
        if not self.drift_overruled:
            return None
        return ("the latency objective overrules the drift monitor's thresholds: the accuracy "
                "budget (--agreement-budget) is not held while the objective is")

    def status(self) -> dict:
        """Where planning stands, for health, /status and tests."""
        plan = self.plan
        return {"objective_ms": 1000 * self.slo, "percentile": 100 * self.q,
                "point": self.point.to_dict(),
                "predicted_ms": _rounded(plan.predicted if plan else None),
                "measured_ms": _rounded(plan.measured if plan else None),
                "met": plan.met if plan else True, "replans": self.replans,
                "backoff_s": self.backoff,
                "pull_deadline_ms": _rounded(plan.pull_deadline if plan else None),
                "drift_overruled": self.drift_overruled}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def _ms(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{1000 * seconds:.0f} ms"
