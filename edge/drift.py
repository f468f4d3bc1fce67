"""Exits that notice drift (after Apparate, Dai et al., SOSP 2024): the early exits' answers
checked against the cloud's, thresholds adapted within an accuracy budget, a drift alarm.

Pure policy: no threads, no network, no metrics (:mod:`ddnn.edge.audit` wires it into the
edge; ``tests/unit/test_drift_policy.py`` tests it alone).

**What is observed.** The edge sees the cloud's answer on every frame it forwards, and on a
small random *audit* sample of the frames that exited early (sent up anyway: such a frame is
answered once, from its early exit; the cloud's answer only checks it). Each is one
:class:`Observation`: the local and edge exits' entropies, whether each exit's class is the
cloud's, and a weight, the inverse of the frame's chance to be observed (1 when forwarded,
1/rate when audited). The weighted observations of the last ``window`` frames stand for all of
those frames (Horvitz–Thompson), whatever thresholds were in force when each was made, so the
hierarchy's disagreement with the cloud can be estimated for any thresholds (:func:`estimate`).

**Adapting** (``--adapt-thresholds``). When the disagreement at the thresholds in force is over
the budget with confidence (``Z`` standard errors), they drop at once to the pair the estimate
allows, by calibration's objective (``models/calibrate.py``: most local exits, then most edge
exits) with the cloud's answers as the labels (:func:`best_within`). When one step up is within
the budget with confidence, they relax by :data:`RELAX_STEP`, never past the configured
thresholds (the bundle's calibration, checked against labels, or the operator's overrides).

**The drift alarm** rises when the disagreement at the *configured* thresholds is over the
budget with confidence, and falls when its estimate is back within it: the bundle no longer
fits the data here. Adapting keeps the answers within the budget meanwhile; federated
fine-tuning (``ddnn federate``) fixes the cause.

**Investigations.** An audited frame is 1/rate frames' worth of evidence, so a small sample sees
a moderate drift slowly. What the local exit does at its configured threshold is known for
every frame, free: when the share it takes over the last :data:`PROBE` frames moves more than
:data:`SHIFT` from the share before, the window starts afresh (the frames before describe
another domain) and every early exit is audited for the next :data:`INVESTIGATE` frames.

A shifting share cannot blind the monitor (a scene that alternates, or a stream shaped to shift
every :data:`PROBE` frames, would otherwise restart the window before it spans the
:data:`MIN_FRAMES` a decision needs, forever, and keep every early exit audited): once nothing
has been decided for :data:`DEFER` frames, the window reaches back :data:`MIN_FRAMES` frames
whatever restarted it, and the frames audited so far decide; a shift during an investigation
extends it to at most twice its length, and the next one starts no sooner than
:data:`INVESTIGATION_GAP` frames after the last one began (at most two thirds of the frames are
investigated, however the share moves). Shifts that start no investigation are counted
(``ignored_shifts``).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddnn.errors import ConfigError
from ddnn.plumbing.options import Option, boolean

Z = 2.0  # standard errors of confidence (one-sided, about 98 %) for the alarm and adapting
MIN_FRAMES = 100  # frames in the window before anything is decided
EVERY = 16  # new observations between two decisions
RELAX_STEP = 0.05  # how far a threshold may relax at one decision
GRID = np.round(np.arange(101) * 0.01, 2)  # the thresholds adapting chooses from
PROBE, SHIFT, INVESTIGATE = 50, 0.2, 300  # the investigation of a shift (see above)
INVESTIGATION_RATE = 1.0  # the audit rate while investigating: every early exit
# Frames from the start of one investigation to the next at the soonest (one lasts at most
# 2 x INVESTIGATE): a bound on the audits a shifting share can cause.
INVESTIGATION_GAP = 3 * INVESTIGATE
DEFER = 2 * MIN_FRAMES  # frames without a decision after which restarts no longer shrink it


@dataclass(frozen=True, kw_only=True)
class DriftPolicy:
    """How the edge checks its exits against the cloud (``--audit-rate``, ``--agreement-budget``,
    ``--drift-window``, ``--adapt-thresholds``)."""

    audit_rate: float = 0.0  # share of early exits sent up anyway; 0: no monitoring
    agreement_budget: float = 0.01  # share of answers that may disagree with the cloud's
    window: int = 1000  # frames the estimates look back over
    adapt_thresholds: bool = False  # move the thresholds within the budget at run time

    def __post_init__(self) -> None:
        if not 0.0 <= self.audit_rate <= 1.0:
            raise ConfigError(f"audit_rate must lie in [0, 1], got {self.audit_rate}")
        if not 0.0 < self.agreement_budget < 1.0:
            raise ConfigError(f"agreement_budget must lie in (0, 1), got {self.agreement_budget}")
        if self.window < MIN_FRAMES:
            raise ConfigError(f"drift_window must be at least {MIN_FRAMES} frames, got "
                              f"{self.window}")
        if self.adapt_thresholds and self.audit_rate == 0:
            raise ConfigError("--adapt-thresholds needs --audit-rate above 0: the early exits' "
                              "answers are checked on the audit sample")

    @property
    def monitoring(self) -> bool:
        return self.audit_rate > 0


DRIFT_OPTIONS = (
    Option("audit-rate", float, "P",
           "share of the frames that exit early which are sent up anyway, so the cloud's answer "
           "checks the early one (the frame is still answered once, from its early exit; an "
           "audit at the local exit pulls the frame's features); 0: no drift monitoring"),
    Option("agreement-budget", float, "D",
           "share of the answers that may disagree with the cloud's: the drift alarm rises "
           "above it, and adapted thresholds keep within it"),
    Option("drift-window", int, "FRAMES", "frames the agreement estimates look back over",
           key="window"),
    Option("adapt-thresholds", boolean, "BOOL",
           "tighten the exit thresholds when the early answers disagree with the cloud's more "
           "than the budget allows, and relax them back (never past the configured ones) when "
           "they agree again; needs --audit-rate"),
)


@dataclass(frozen=True)
class Thresholds:
    local: float
    edge: float

    def as_dict(self) -> dict[str, float]:
        return {"local": self.local, "edge": self.edge}


@dataclass(frozen=True)
class Observation:
    """One frame whose early answers the cloud's answer checked."""

    local_entropy: float  # inf where the edge has no local exit (a one-view device decides it)
    local_agrees: bool  # the local exit's class is the cloud's
    edge_entropy: float
    edge_agrees: bool
    weight: float  # 1 / the chance that this frame was observed


@dataclass(frozen=True)
class Observations:
    """A window's observations as arrays (one row each)."""

    local_entropy: np.ndarray
    local_agrees: np.ndarray
    edge_entropy: np.ndarray
    edge_agrees: np.ndarray
    weight: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[Observation]) -> Observations:
        a = np.array([(o.local_entropy, o.local_agrees, o.edge_entropy, o.edge_agrees, o.weight)
                      for o in rows], dtype=np.float64).reshape(-1, 5)
        return cls(a[:, 0], a[:, 1] > 0, a[:, 2], a[:, 3] > 0, a[:, 4])

    def __len__(self) -> int:
        return len(self.weight)


@dataclass(frozen=True)
class Estimate:
    """The hierarchy's disagreement with the cloud at some thresholds, over a window."""

    disagreement: float  # weighted share of answers that are not the cloud's
    stderr: float  # its standard error (the ratio estimator's, from the observations)
    local: float  # estimated share of frames answered by the local exit
    edge: float  # and by the edge exit
    frames: float  # frames the observations stand for (their weights' sum)

    @property
    def agreement(self) -> float:
        return 1.0 - self.disagreement

    def over(self, budget: float) -> bool:
        """Over the budget with confidence (the lower bound is)."""
        return self.disagreement - Z * self.stderr > budget

    def within(self, budget: float) -> bool:
        """Within the budget with confidence (the upper bound is)."""
        return self.disagreement + Z * self.stderr <= budget


def estimate(obs: Observations, t: Thresholds) -> Estimate | None:
    """The disagreement with the cloud of the answers the exits would give at ``t``, from the
    window's weighted observations (None without any)."""
    w = obs.weight
    total = float(w.sum())
    if not len(obs) or total <= 0:
        return None
    local = obs.local_entropy < t.local
    edge = ~local & (obs.edge_entropy < t.edge)
    wrong = (local & ~obs.local_agrees) | (edge & ~obs.edge_agrees)
    d = float((w * wrong).sum()) / total
    stderr = math.sqrt(float((w ** 2 * (wrong - d) ** 2).sum())) / total
    return Estimate(d, stderr, float((w * local).sum()) / total,
                    float((w * edge).sum()) / total, total)


def _cumulative(x: np.ndarray) -> np.ndarray:
    return np.concatenate(([0.0], np.cumsum(x)))


def best_within(obs: Observations, ceiling: Thresholds, budget: float) -> Thresholds:
    """The thresholds on :data:`GRID`, at most ``ceiling``, with the most local exits, then the
    most edge exits (the smallest thresholds that get them), whose estimated disagreement is
    within ``budget``. (0, 0) sends everything to the cloud, always within."""
    order = np.argsort(obs.local_entropy, kind="stable")
    el, w = obs.local_entropy[order], obs.weight[order]
    ee, local_ok, edge_ok = obs.edge_entropy[order], obs.local_agrees[order], obs.edge_agrees[order]
    allowed = budget * float(w.sum()) + 1e-12
    t_local = GRID[:np.searchsorted(GRID, ceiling.local + 1e-9, side="right")]
    k = np.searchsorted(el, t_local, side="left")  # observations under each local threshold
    local_wrong = _cumulative(w * ~local_ok)[k]
    local_mass = _cumulative(w)[k]
    best, best_key = Thresholds(0.0, 0.0), (-1.0, -1.0)
    for te in GRID[:np.searchsorted(GRID, ceiling.edge + 1e-9, side="right")]:
        exits = ee < te
        edge_wrong = _cumulative(w * (exits & ~edge_ok))
        edge_mass = _cumulative(w * exits)
        ok = np.flatnonzero(local_wrong + edge_wrong[-1] - edge_wrong[k] <= allowed)
        if not ok.size:
            continue
        i = int(ok[np.argmax(local_mass[ok])])  # the first of the most local exits
        key = (float(local_mass[i]), float(edge_mass[-1] - edge_mass[k[i]]))
        if key > best_key:
            best, best_key = Thresholds(float(t_local[i]), float(te)), key
    return best


class ShareShift:
    """Whether the share of frames the local exit takes (at its configured threshold) has moved
    more than :data:`SHIFT` between the last :data:`PROBE` frames and the ``window`` before."""

    def __init__(self, window: int):
        self.window = window
        self._recent: collections.deque[bool] = collections.deque()
        self._older: collections.deque[bool] = collections.deque()
        self._recent_sum = self._older_sum = 0

    def frame(self, early: bool) -> bool:
        """One frame's local exit; True when the shares have just moved apart."""
        self._recent.append(early)
        self._recent_sum += early
        if len(self._recent) > PROBE:
            old = self._recent.popleft()
            self._recent_sum -= old
            self._older.append(old)
            self._older_sum += old
            if len(self._older) > self.window:
                self._older_sum -= self._older.popleft()
        if len(self._older) < PROBE:
            return False
        moved = abs(self._recent_sum / len(self._recent) - self._older_sum / len(self._older))
        if moved <= SHIFT:
            return False
        self._older.clear()  # the recent frames are the new reference
        self._older_sum = 0
        return True


@dataclass(frozen=True)
class Decision:
    """What :meth:`AgreementMonitor.decide` concluded."""

    thresholds: Thresholds  # in force from now on
    alarm: bool
    in_force: Estimate | None  # the estimate at the thresholds that were in force
    configured: Estimate | None  # and at the configured ones


class AgreementMonitor:
    """The policy over a stream of frames: the window of observations, the thresholds in force,
    the alarm, the investigations. Not thread-safe (:mod:`ddnn.edge.audit` serializes it);
    :meth:`decide` reads a copy of the window, so the estimates can run outside a lock."""

    def __init__(self, policy: DriftPolicy, configured: Thresholds):
        self.policy, self.configured = policy, configured
        self.thresholds = configured  # in force
        self.alarm = False
        self.raised_at: int | None = None  # the frame count when the alarm last rose
        self.frames = 0  # frames counted so far: the window's clock
        self.shifts = 0  # investigations started
        self.ignored_shifts = 0  # shifts that started no investigation
        self._decided_at = 0  # the frame count when the window last spanned enough to decide
        self._investigated_at: int | None = None  # the frame count of the last investigation
        self.last: Decision | None = None
        self._since = 0  # the window starts after this frame (an investigation restarts it)
        self._investigate_until = 0
        self._rows: collections.deque[tuple[int, Observation]] = collections.deque()
        self._new = 0
        self._share = ShareShift(policy.window)

    @property
    def investigating(self) -> bool:
        return self.frames < self._investigate_until

    @property
    def audit_rate(self) -> float:
        """The chance of an early exit to be audited now."""
        return INVESTIGATION_RATE if self.investigating else self.policy.audit_rate

    def frame(self, local_entropy: float | None = None) -> None:
        """Count one frame; ``local_entropy``: its local exit's (None where the edge has none)."""
        self.frames += 1
        if local_entropy is not None and self._share.frame(local_entropy < self.configured.local):
            self._shifted()

    def _shifted(self) -> None:
        """The local exit's share moved: a fresh window and an investigation, within bounds."""
        self._since = max(self.frames - PROBE, self._since)
        start = self._investigated_at
        if start is None or self.frames - start >= INVESTIGATION_GAP:
            self.shifts += 1
            self._investigated_at = self.frames
            self._investigate_until = self.frames + INVESTIGATE
        elif self.investigating:
            self._investigate_until = min(self.frames + INVESTIGATE, start + 2 * INVESTIGATE)
        else:
            self.ignored_shifts += 1

    def observe(self, o: Observation) -> bool:
        """One frame the cloud checked; True when a decision is due (:meth:`window`,
        :meth:`decide`, :meth:`apply`)."""
        self._rows.append((self.frames, o))
        self._new += 1
        return self._new >= EVERY

    def window(self) -> tuple[list[Observation], int]:
        """A copy of the window's observations, and how many frames it spans."""
        start = max(self.frames - self.policy.window, self._since)
        if self.frames - self._decided_at >= DEFER:  # restarts kept it from deciding: no more
            start = max(min(start, self.frames - MIN_FRAMES), 0)
        # Rows a later window may still reach back to stay (a restart shrinks the window now,
        # but past DEFER the last MIN_FRAMES frames decide, observations and all).
        keep_from = min(start, self.frames - MIN_FRAMES)
        while self._rows and self._rows[0][0] <= keep_from:
            self._rows.popleft()
        self._new = 0
        span = self.frames - start
        if span >= MIN_FRAMES:
            self._decided_at = self.frames  # (decide runs on this window next)
        return [o for f, o in self._rows if f > start], span

    def decide(self, rows: Sequence[Observation], span: int) -> Decision:
        """What the window says; nothing changes until :meth:`apply`."""
        budget, obs = self.policy.agreement_budget, Observations.of(rows)
        now, conf = estimate(obs, self.thresholds), estimate(obs, self.configured)
        if span < MIN_FRAMES or now is None or conf is None:
            return Decision(self.thresholds, self.alarm, now, conf)
        alarm = conf.over(budget) or (self.alarm and conf.disagreement > budget)
        t = self.thresholds
        if self.policy.adapt_thresholds:
            t = best_within(obs, t, budget) if now.over(budget) else self._relaxed(obs, t)
        return Decision(t, alarm, now, conf)

    def _relaxed(self, obs: Observations, t: Thresholds) -> Thresholds:
        """One step up for each exit below its configured threshold, where the step is within
        the budget with confidence."""
        for tier in ("local", "edge"):
            ceiling = getattr(self.configured, tier)
            if getattr(t, tier) >= ceiling:
                continue
            step = {**t.as_dict(), tier: min(getattr(t, tier) + RELAX_STEP, ceiling)}
            candidate = Thresholds(**step)
            e = estimate(obs, candidate)
            if e is not None and e.within(self.policy.agreement_budget):
                t = candidate
        return t

    def apply(self, d: Decision) -> None:
        if d.alarm and not self.alarm:
            self.raised_at = self.frames
        self.thresholds, self.alarm, self.last = d.thresholds, d.alarm, d
