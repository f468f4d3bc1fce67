"""Escalation: a frame still unsure after the edge exit brings the cloud its cameras' detail.

A bundle that escalates (``manifest.escalated``, at ``manifest.escalation_level`` 1, as
calibration chose) has a cloud that answers best from the edge features *and* the senders'
details (each camera's view at reduced resolution, :mod:`ddnn.hierarchy`). For a frame its exit
leaves, the edge pulls those details: one ``DETAIL_REQUEST`` on its requests topic names the
senders (every present view, or the ``escalation_views`` whose scores are surest:
:func:`ddnn.hierarchy.surest_views`, the same choice as ``ddnn evaluate``), each answers with
its kept ``DETAIL``, and the frame goes on to the cloud stage with the details in the bundle's
slot order (:meth:`~ddnn.runtime.BundleRuntime.escalated`'s input). A detail that misses the
deadline leaves its slot zero (the network trained with views missing); it is counted
(``ddnn_edge_missing_views_total{stage="detail"}``), and the view stays among the result's
fused views (its scores and features were). A device that keeps missing detail pulls is passed
over (:mod:`ddnn.edge.detail_suspects`): its slot stays empty and no frame waits for it, but for
a probe now and then. Thread-safe: details arrive on the MQTT thread,
frames come from the worker (or the MQTT thread), deadlines run on the worker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ddnn import envelope as env
from ddnn.aggregation import aggregate
from ddnn.bundle import Manifest
from ddnn.edge.cloud_stage import CloudStage
from ddnn.edge.detail_suspects import DetailSuspects
from ddnn.edge.events import EdgeEvents
from ddnn.edge.frame import Drop, Frame
from ddnn.edge.pipeline import Scores, ToCloud
from ddnn.envelope import MessageType
from ddnn.exits import entropy_of_logits
from ddnn.topics import DELIVERY

MAX_WAITING = 4096  # frames waiting for details at once: more go up without (bounded memory)


@dataclass
class Escalating:
    """A frame waiting for its senders' details."""

    frame: Frame
    sent: ToCloud
    senders: tuple[int, ...]  # views whose details it brings, in slot order (surest first,
    # or view order)
    deadline: float  # monotonic
    since: float  # monotonic: when it was handed over to go up (its cloud path's start)
    asked: tuple[int, ...] = ()  # of the senders, those pulled and waited for (not suspects)
    details: dict[int, np.ndarray] = field(default_factory=dict)  # view -> (1, c, r, r)

    @property
    def complete(self) -> bool:
        return len(self.details) == len(self.asked)


def senders(scores: Mapping[int, Scores], k: int) -> tuple[int, ...]:
    """The views whose details an escalated frame brings: every view that sent scores, or
    (``k`` > 0) the ``k`` of them whose scores are surest, surest first, ties to the lower view
    (:func:`ddnn.hierarchy.surest_views`, over the scores as the edge received them)."""
    present = sorted(scores)
    if not k or not present:
        return tuple(present)
    rows = np.stack([np.asarray(scores[v], np.float32) for v in present])
    entropy = entropy_of_logits(rows)
    order = np.argsort(entropy, kind="stable")[:k]
    return tuple(present[i] for i in order)


class DetailPulls:
    """Pulls the details of escalated frames and hands them on to the ``cloud`` stage.

    ``publish(topic, payload, qos)`` sends the pulls on ``topic`` (None: nobody can be asked,
    as over HTTP, and frames go up without details); ``deadline``: seconds a frame waits for
    them.
    """

    def __init__(self, publish: Callable[[str, bytes, int], object] | None, topic: str,
                 events: EdgeEvents, deadline: float, cloud: CloudStage, *,
                 devices: Sequence[str]):
        self._publish, self.topic, self.events = publish, topic, events
        self.deadline, self.cloud = deadline, cloud
        self.suspects = DetailSuspects(devices, events)  # who is passed over, under _lock
        self._waiting: dict[int, Escalating] = {}
        self._lock = threading.Lock()

    def send_up(self, f: Frame, sent: ToCloud) -> None:
        """A frame the edge exit left goes up: with its cameras' details where its bundle
        version escalates (level 1). An audited frame takes them wherever the bundle has an
        escalated cloud, at level 0 too: it is checked against the cloud's best answer, which
        the drift monitor and the experience recorder learn from (a sensor drift can fool the
        plain cloud with the early exits while the escalated one holds; the level was chosen
        on the home domain: docs/federated-learning.md, "The cloud as the only teacher"). A
        probe goes the way a frame sent up goes."""
        m = f.runs_on.manifest
        check = bool(sent.audit) and not sent.probe
        if m.escalated is None or m.views < 2 or (m.escalation_level < 1 and not check):
            self.cloud.put(f, sent)
        else:
            self._escalate(f, sent, m)

    def _escalate(self, f: Frame, sent: ToCloud, m: Manifest) -> None:
        """Pull the frame's details (it goes on when they are in, or at the deadline)."""
        slots = senders(f.scores, m.escalation_views)
        with self._lock:
            asked = self.suspects.ask(slots)
            if self._publish is None or not asked or len(self._waiting) >= MAX_WAITING:
                asked = ()
            else:
                now = time.monotonic()
                self._waiting[f.id] = Escalating(f, sent, slots, now + self.deadline, now,
                                                 asked)
        if not asked:
            self.cloud.put(f, self._with_details(sent, slots, {}, m))
            return
        self._request(f.id, asked, m)

    def _request(self, frame: int, views: tuple[int, ...], m: Manifest) -> None:
        mask = np.full(m.views, -1.0, np.float32)
        mask[list(views)] = 1.0
        req = env.pack(MessageType.DETAIL_REQUEST, version=m.version, frame=frame, tensor=mask,
                       codec="binary")
        if self._publish is not None:  # (None: nothing waits for details, see _escalate)
            self._publish(self.topic, env.encode(req), DELIVERY["requests"].qos)
            self.events.on_pulled("detail")

    def add(self, view: int, frame: int, detail: np.ndarray) -> None:
        """A device's detail of ``frame`` (MQTT thread); a Drop when it was not asked for."""
        with self._lock:
            e = self._waiting.get(frame)
            if e is None or view not in e.asked:
                raise Drop("unrequested", f"detail of view {view} for frame {frame} was not "
                                          "pulled (or came after its deadline)", view=view)
            if view in e.details:
                raise Drop("duplicate", f"detail of view {view} of frame {frame} arrived twice")
            e.details[view] = detail
            self.suspects.answered(view)
            if not e.complete:
                return
            del self._waiting[frame]
        self._send(e)

    def expire(self, now: float) -> None:
        """Send on the frames whose details are past their deadline, with those that came."""
        with self._lock:
            due = [e for e in self._waiting.values() if e.deadline <= now]
            for e in due:
                del self._waiting[e.frame.id]
                self.suspects.missed(v for v in e.asked if v not in e.details)
        for e in due:
            late = len(e.asked) - len(e.details)
            self.events.on_missing("detail", late)
            self._send(e)

    def again(self) -> None:
        """Pull again what the waiting frames still miss (after a reconnection)."""
        with self._lock:
            waiting = [(e.frame, tuple(v for v in e.asked if v not in e.details))
                       for e in self._waiting.values()]
            now = time.monotonic()
            for e in self._waiting.values():
                e.deadline = now + self.deadline
        for f, views in waiting:
            if views:
                self._request(f.id, views, f.runs_on.manifest)

    def _send(self, e: Escalating) -> None:
        m = e.frame.runs_on.manifest
        # (the cloud path's cost counts the wait for the details: a slow pull slows it)
        self.cloud.put(e.frame, self._with_details(e.sent, e.senders, e.details, m),
                       since=e.since)

    @staticmethod
    def _with_details(sent: ToCloud, asked: tuple[int, ...],
                      details: dict[int, np.ndarray], m: Manifest) -> ToCloud:
        """``sent`` with the details in the bundle's slots: slot i holds the i-th sender's
        (``escalation_views``) or view i's (every view), zeros where none came."""
        shape = m.devices[0].output("detail").sample_shape
        slots = m.escalation_views or m.views
        x = np.zeros((1, slots, *shape), np.float32)
        present = np.zeros((1, slots), bool)
        for i, v in enumerate(asked):
            slot = i if m.escalation_views else v
            if v in details:
                x[0, slot] = np.reshape(details[v], shape)
                present[0, slot] = True
        return replace(sent, detail=aggregate(x, present, "concat"))

    def flagged(self) -> dict[int, list[str]]:
        """The views passed over for details, and why (for the health checks)."""
        with self._lock:
            return self.suspects.flagged()

    def __len__(self) -> int:
        return len(self._waiting)
