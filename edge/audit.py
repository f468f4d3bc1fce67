"""The edge's exits checked against the cloud (``--audit-rate``): the drift policy of
:mod:`ddnn.edge.drift` wired into the frame path.

:class:`ExitAudit` picks the early exits that go up anyway (an audited frame is answered once,
from its early exit: at the local exit its features are pulled, at the edge exit its edge
features are at hand), feeds the cloud's answer to every frame it saw (forwarded or audited) to
the :class:`~ddnn.edge.drift.AgreementMonitor`, applies the thresholds it adapts to the
pipeline new frames run on, and says where things stand for metrics and health.

The frame path only draws a random number and counts under a lock (microseconds); the
estimates run on the cloud stage's thread, outside the lock, every few observations.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable

import numpy as np

from ddnn.edge.drift import (
    AgreementMonitor,
    Decision,
    DriftPolicy,
    Observation,
    Thresholds,
)
from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.frame import Frame
from ddnn.edge.pipeline import Exit, ExitPipeline, Pull, ToCloud

log = logging.getLogger(__name__)

HELD = 4096  # frames answered at the local exit and waiting for their audit, at most


class ExitAudit:
    """Which early exits the cloud checks, and what its answers say.

    ``pipeline()`` is the :class:`~ddnn.edge.pipeline.ExitPipeline` new frames run on (its
    policy's thresholds are the configured ones when :meth:`reset` runs, and the adapted ones
    are applied to it). What it decides is reported through ``events`` (``on_audit``,
    ``on_investigation``, ``on_threshold_change``, ``on_drift``, ``on_thresholds``).
    """

    def __init__(self, policy: DriftPolicy, pipeline: Callable[[], ExitPipeline | None], *,
                 events: EdgeEvents = NO_EVENTS, seed: int | None = None):
        self.policy, self.events = policy, events
        self._pipeline = pipeline
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._held: dict[int, float] = {}  # frame id → the chance of its local exit's audit
        self.monitor: AgreementMonitor | None = None
        self._version = ""
        self._shifts = 0

    @classmethod
    def off(cls) -> ExitAudit:
        """An audit that picks nothing (no ``--audit-rate``)."""
        return cls(DriftPolicy(), lambda: None)

    @property
    def on(self) -> bool:
        return self.policy.monitoring

    def reset(self) -> None:
        """Start afresh on the pipeline new frames run on: at the start, and after a bundle
        update (another bundle, other configured thresholds, nothing known of its exits)."""
        if not self.on:
            return
        p = self._pipeline()
        if p is None:
            return
        configured = Thresholds(p.policy.threshold("local"), p.policy.threshold("edge"))
        with self._lock:
            self.monitor = AgreementMonitor(self.policy, configured)
            self._version, self._shifts = p.manifest.version, 0
            self._held.clear()
        self._report(None, self.monitor)

    # --- the frame path ---------------------------------------------------------------------

    def local(self, f: Frame, decision: Exit | Pull) -> bool:
        """Count a frame at its local exit; True: it exits here and is audited (answer it, then
        pull its features and go on up: :meth:`answered` says so at the edge exit)."""
        if not self.on:
            return False
        answer = decision if isinstance(decision, Exit) else decision.answer
        with self._lock:
            m = self._monitor()
            m.frame(answer.entropy)
            started = m.shifts != self._shifts
            self._shifts = m.shifts
            rate = m.audit_rate
            audited = isinstance(decision, Exit) and self._rng.random() < rate
            if audited:
                if len(self._held) >= HELD:  # frames that never came back: forget the oldest
                    self._held.pop(next(iter(self._held)))
                self._held[f.id] = rate
        if started:
            self.events.on_investigation()
            log.info("the local exit's share moved: auditing every early exit for a while")
        if audited:
            self.events.on_audit("local")
        return audited

    def answered(self, f: Frame) -> float:
        """At the edge exit: the chance of the audit of a frame its local exit answered, else 0."""
        if not self.on:
            return 0.0
        with self._lock:
            return self._held.pop(f.id, 0.0)

    def edge(self, f: Frame) -> float:
        """At the edge exit: the chance of an audit if this frame is drawn for one, else 0 (a
        one-view device's frame, which has no local exit here, is counted here)."""
        if not self.on:
            return 0.0
        with self._lock:
            m = self._monitor()
            if f.local is None:
                m.frame(None)
            rate = m.audit_rate
            return rate if self._rng.random() < rate else 0.0

    def sent(self, sent: ToCloud) -> None:
        """An edge exit answered and sent up to be checked."""
        self.events.on_audit("edge")

    # --- the cloud's answers (the cloud stage's thread) ---------------------------------------

    def observe(self, f: Frame, sent: ToCloud, answer: Exit) -> None:
        """The cloud answered a frame the edge forwarded or audited."""
        if not self.on or sent.version != self._version:
            return  # a frame of the bundle before an update says nothing of this one
        cloud = int(np.argmax(answer.scores))
        local = f.local
        o = Observation(
            local_entropy=local.entropy if local is not None else math.inf,
            local_agrees=local is not None and int(np.argmax(local.scores)) == cloud,
            edge_entropy=sent.fallback.entropy,
            edge_agrees=int(np.argmax(sent.fallback.scores)) == cloud,
            weight=1.0 / sent.audit if sent.audit else 1.0)
        with self._lock:
            m = self.monitor
            if m is None or not m.observe(o):
                return
            rows, span = m.window()
        decision = m.decide(rows, span)  # the estimates: outside the lock
        with self._lock:
            if m is not self.monitor:
                return  # reset meanwhile (a bundle update)
            before = (m.thresholds, m.alarm)
            m.apply(decision)
        self._applied(m, decision, *before)

    def _applied(self, m: AgreementMonitor, d: Decision, thresholds: Thresholds,
                 alarm: bool) -> None:
        if d.thresholds != thresholds:
            p = self._pipeline()
            if p is not None and p.manifest.version == self._version:
                p.policy = p.policy.with_overrides(**d.thresholds.as_dict())
            tighter = d.thresholds.local + d.thresholds.edge < thresholds.local + thresholds.edge
            self.events.on_threshold_change("tighten" if tighter else "relax")
            log.info("exit thresholds %s: local %.2f, edge %.2f (agreement with the cloud %.3f)",
                     "tightened" if tighter else "relaxed", d.thresholds.local,
                     d.thresholds.edge, d.in_force.agreement if d.in_force else math.nan)
        if d.alarm != alarm:
            if d.alarm:
                log.warning("%s", self.reason())  # ("drift: ...")
            else:
                log.info("drift alarm cleared: the early exits agree with the cloud again")
        self._report(d, m)

    def _monitor(self) -> AgreementMonitor:
        """The monitor, once :meth:`reset` made it (under the lock)."""
        if self.monitor is None:
            raise RuntimeError("the exit audit runs before it was reset")
        return self.monitor

    def _report(self, d: Decision | None, m: AgreementMonitor) -> None:
        self.events.on_drift(d, m)
        self.events.on_thresholds(m.thresholds.as_dict())

    # --- where things stand ---------------------------------------------------------------

    def reason(self) -> str | None:
        """Why the drift alarm is up, in a sentence (None while it is not)."""
        m = self.monitor
        if m is None or not m.alarm or m.last is None or m.last.configured is None:
            return None
        e, t = m.last.configured, m.thresholds
        return (f"drift: at the configured thresholds (local {m.configured.local:.2f}, edge "
                f"{m.configured.edge:.2f}) the exits' answers agree with the cloud's on "
                f"{100 * e.agreement:.1f} % of the last {e.frames:.0f} frames, under the "
                f"budget of {100 * (1 - self.policy.agreement_budget):.1f} % "
                f"(--agreement-budget); thresholds in force: local {t.local:.2f}, edge "
                f"{t.edge:.2f}")

    def status(self) -> dict | None:
        """The monitor's state for health answers (None when it is off)."""
        m = self.monitor
        if not self.on or m is None:
            return None
        last = m.last

        def rounded(e) -> float | None:
            return None if e is None else round(e.agreement, 4)

        return {"alarm": m.alarm, "budget": self.policy.agreement_budget,
                "agreement": rounded(last and last.in_force),
                "agreement_configured": rounded(last and last.configured),
                "thresholds": m.thresholds.as_dict(), "configured": m.configured.as_dict(),
                "audit_rate": m.audit_rate, "investigating": m.investigating,
                "frames": m.frames, "alarm_raised_at_frame": m.raised_at,
                "ignored_shifts": m.ignored_shifts,
                "adapt": self.policy.adapt_thresholds}
