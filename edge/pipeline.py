"""The exits a frame walks up at the edge: frame in, decision out.

1. local exit: the devices' scores aggregated over the views present (``BundleRuntime.local``);
   confident: answer; else pull the present views' features;
2. edge exit: the features that arrived, aggregated, through the edge segment
   (``BundleRuntime.edge``), stacked on the local answer where the bundle stacks its exits
   (``ddnn.stacking``); confident: answer; else
3. send the edge features, as they go on the wire, to the cloud; its scores (stacked on the
   edge's answer) answer the frame (:meth:`ExitPipeline.cloud`), or the edge's own exit does,
   degraded, when it cannot.

Every step is the one ``ddnn evaluate`` runs (``BundleRuntime.all_exits``), fed with the tensors
as they crossed the wire, so the live hierarchy's answers equal the offline evaluation's. Pure:
no threads, no MQTT, no metrics; compute times are reported as events
(:meth:`~ddnn.edge.events.EdgeEvents.on_computed`).
"""

from __future__ import annotations

import math
import operator
import time
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import numpy as np

from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.exits import ExitPolicy, entropy_of_logits
from ddnn.runtime import BundleRuntime, transmit
from ddnn.stacking import Stacking, stack

# One view's class scores as the edge holds them: C floats as read off the wire (the hot path),
# or an array.
Scores = Union[np.ndarray, tuple[float, ...]]  # noqa: UP007 - a runtime alias on Python 3.10


@dataclass(frozen=True)
class Exit:
    """Answer the frame at ``tier`` with these class scores."""

    tier: str  # "local", "edge" or "cloud"
    scores: np.ndarray  # (C,) class scores of that exit
    entropy: float  # normalized entropy of those scores
    views: tuple[int, ...]  # the views fused into the answer


@dataclass(frozen=True)
class Pull:
    """Not confident at the local exit: the edge segment fuses the features of ``views``."""

    views: tuple[int, ...]  # the present views, whose features the edge segment fuses
    ask: tuple[int, ...]  # of those, the views to request (not arrived, not pushing them)
    answer: Exit  # the local exit's own answer: the fallback if no features arrive at all


@dataclass(frozen=True)
class ToCloud:
    """Not confident at the edge exit: the cloud answers from these edge features."""

    features: np.ndarray  # (1, ...) edge features through the bundle's edge codec
    version: str  # the bundle version they were made with (the cloud segment to use)
    fallback: Exit  # the edge's own answer, for when the cloud cannot give one (degraded)
    # An audit (ddnn.edge.audit): the frame is answered by an early exit and sent up anyway,
    # with this chance, so that the cloud's answer checks the early one; 0: the cloud answers.
    audit: float = 0.0
    # A probe of the latency planner (ddnn.edge.planner): answered already, it goes up the way
    # a frame the edge exit leaves goes (escalated where the bundle escalates), to measure it.
    probe: bool = False
    # An escalated frame (edge.escalation): the senders' details in the bundle's slots,
    # concatenated (1, S·c, r, r), for the cloud's escalated model; None: the plain cloud.
    detail: np.ndarray | None = None
    # The bundle's stacked exits: the cloud's scores stack on ``fallback``'s; None: they answer
    # on their own.
    stacking: Stacking | None = None


GUARD = 1e-9  # |η − T| below which plain floats leave the decision to numpy's arithmetic


def local_max(rows: Sequence[Sequence[float]], threshold: float
              ) -> tuple[list[float], float] | None:
    """One frame's local exit under max aggregation in plain floats: the aggregated scores and
    their normalized entropy, or None when η lies within :data:`GUARD` of ``threshold``.

    The scores are exactly what ``ddnn.aggregation.aggregate`` gives (a maximum is one of its
    operands). The entropy is that of ``ddnn.exits.entropy_of_logits`` up to the last bits
    (libm's exp and log, another order of summation: a few ulps), so the exit decision is the
    same wherever η is not within GUARD of the threshold; there numpy decides. One frame costs
    microseconds this way, against tens for two dozen small numpy calls.
    """
    return _decided([max(column) for column in zip(*rows, strict=True)], threshold)


def local_avg(rows: Sequence[Sequence[float]], threshold: float
              ) -> tuple[list[float], float] | None:
    """:func:`local_max` under avg aggregation (``rows``: the present views' float32 scores, in
    view order).

    The scores are exactly numpy's too: ``aggregate`` sums the views in float32, in view order,
    from +0 (an absent view's zero changes no sum), then divides in float64 and rounds to
    float32. Here each partial sum is taken in float64 and rounded to float32, which is the
    float32 sum (a double holds more than twice a float's digits: one rounding, the same).
    """
    total: Sequence[float] = [0.0] * len(rows[0])
    for row in rows:
        total = array("f", map(operator.add, total, row)).tolist()
    n = len(rows)
    return _decided(array("f", [s / n for s in total]).tolist(), threshold)


def _decided(agg: list[float], threshold: float) -> tuple[list[float], float] | None:
    """``agg`` and its normalized entropy in plain floats, or None within GUARD of
    ``threshold``."""
    top = max(agg)
    e = [math.exp(v - top) for v in agg]
    total = sum(e)
    h = 0.0
    for x in e:
        p = x / total
        if p > 0:
            h -= p * math.log(p)
    eta = min(max(h / math.log(len(agg)), 0.0), 1.0)
    if abs(eta - threshold) <= GUARD:
        return None
    return agg, eta


LocalExit = Callable[[Sequence[Sequence[float]], float], "tuple[list[float], float] | None"]
# The local aggregations with a plain-float path.
_PLAIN: dict[str, LocalExit] = {"max": local_max, "avg": local_avg}


class ExitPipeline:
    """The exits of one bundle version under one exit policy."""

    def __init__(self, runtime: BundleRuntime, policy: ExitPolicy, *,
                 events: EdgeEvents = NO_EVENTS):
        self.runtime, self.policy = runtime, policy
        m = self.manifest = runtime.manifest
        self._feature_shape = tuple(m.devices[0].output("features").sample_shape)
        self._absent = bytes(4 * m.num_classes)  # an absent view's row of scores: zeros
        self.events = events  # (compute times: on_computed)
        # One frame's local exit in plain floats where that decides exactly (local_max,
        # local_avg); then batching frames buys nothing (setting ``plain_local`` False forces
        # numpy, for tests).
        self._plain = _PLAIN.get(m.aggregation["local"])
        self.plain_local = m.local is None and self._plain is not None and m.num_classes >= 2

    @property
    def classes(self) -> Sequence[str]:
        return self.manifest.classes

    def local(self, scores: Mapping[int, Scores], *, arrived: Collection[int] = (),
              pushing: Collection[int] = ()) -> Exit | Pull:
        """The local exit over the views present (``scores``: view → its (C,) scores).

        ``arrived``: views whose features are already here; ``pushing``: views whose devices
        send features unasked. Neither is asked for features.
        """
        if self._plain is not None and self.plain_local and scores:
            t0 = time.perf_counter()
            threshold = self.policy.threshold("local")
            decided = self._plain([np.ravel(s).tolist() if isinstance(s, np.ndarray) else s
                                   for _, s in sorted(scores.items())], threshold)
            if decided is not None:
                agg, eta = decided
                self.events.on_computed("local", time.perf_counter() - t0)
                return self._decide(scores, np.array(agg, np.float32), eta, eta < threshold,
                                    arrived, pushing)
        return self.local_many([scores], arrived=[arrived], pushing=pushing)[0]

    def _decide(self, scores: Mapping[int, Scores], local: np.ndarray, eta: float,
                leave: bool, arrived: Collection[int], pushing: Collection[int]) -> Exit | Pull:
        present = tuple(sorted(scores))
        answer = Exit("local", local, eta, present)
        if leave:
            return answer
        ask = tuple(v for v in present if v not in arrived and v not in pushing)
        return Pull(present, ask, answer)

    def local_many(self, frames: Sequence[Mapping[int, Scores]], *,
                   arrived: Sequence[Collection[int]] | None = None,
                   pushing: Collection[int] = ()) -> list[Exit | Pull]:
        """:meth:`local` of several frames in one vectorised call (one row per frame).

        The rows are computed exactly as one at a time (and as ``ddnn evaluate`` does): the
        aggregation and the entropy work row by row, whatever the batch.
        """
        m = self.manifest
        t0 = time.perf_counter()
        # (B, V, C) and its mask from bytes in two calls, not one numpy call per view: the
        # local exit is on every frame's path, and small numpy calls cost more than their math.
        rows, mask = [], []
        for scores in frames:
            for v in range(m.views):
                s = scores.get(v)
                rows.append(self._absent if s is None else np.asarray(s, np.float32).tobytes())
                mask.append(s is not None)
        data = bytearray().join(rows)
        if len(data) != len(frames) * m.views * len(self._absent):
            raise ValueError(f"scores must hold {m.num_classes} values per view")
        x = np.frombuffer(data, np.float32).reshape(len(frames), m.views, m.num_classes)
        local = self.runtime.local(x, np.array(mask).reshape(len(frames), m.views))
        etas = entropy_of_logits(local).tolist()
        threshold = self.policy.threshold("local")  # ExitPolicy.exits: η < T
        self.events.on_computed("local", time.perf_counter() - t0)
        return [self._decide(scores, local[i], etas[i], etas[i] < threshold,
                             arrived[i] if arrived is not None else (), pushing)
                for i, scores in enumerate(frames)]

    def edge(self, features: Mapping[int, np.ndarray], *, audit: float = 0.0,
             below: np.ndarray | None = None) -> Exit | ToCloud:
        """The edge exit over the features that arrived (view → that view's features).

        A view whose features never came is left out of the fusion, never zero-filled in; with
        none at all there is nothing to fuse (the caller answers from the local exit).
        ``audit`` above 0: a confident edge exit still goes up, as a :class:`ToCloud` whose
        ``audit`` is that chance (the caller answers from its ``fallback``). ``below``: the
        local exit's (C,) scores, which a bundle with stacked exits answers on top of.
        """
        if not features:
            raise ValueError("the edge exit needs the features of at least one view")
        m = self.manifest
        t0 = time.perf_counter()
        fused = tuple(sorted(features))
        x = np.zeros((1, m.views, *self._feature_shape), np.float32)
        mask = np.zeros((1, m.views), bool)
        for v in fused:
            x[0, v] = np.reshape(features[v], self._feature_shape)
            mask[0, v] = True
        edge_scores, edge_features = self.runtime.edge(x, mask)
        stacking = m.stacking
        if stacking is not None:
            edge_scores = stack(None if below is None else np.reshape(below, (1, -1)),
                                edge_scores, stacking.edge)
        eta = float(entropy_of_logits(edge_scores)[0])
        self.events.on_computed("edge", time.perf_counter() - t0)
        answer = Exit("edge", edge_scores[0], eta, fused)
        confident = bool(self.policy.exits("edge", eta))
        if confident and not audit:
            return answer
        return ToCloud(transmit(edge_features, self.runtime.edge_codec), m.version, answer,
                       audit=audit if confident else 0.0, stacking=stacking)

    @staticmethod
    def cloud(scores: np.ndarray, sent: Sequence[ToCloud], *, escalated: bool = False,
              stacked: bool = True) -> list[Exit]:
        """The cloud's answers: its scores (B, C) for the frames ``sent`` in one call (from the
        ``escalated`` model or the plain one), stacked on the edge's where the bundle stacks
        its exits (``stacked`` False: the cloud's own, which check the early exits
        independently of them)."""
        if stacked:
            tier = "escalated" if escalated else "cloud"
            scores = np.array([stack(t.fallback.scores[None], s[None], t.stacking.weight(tier))[0]
                               if t.stacking is not None else s
                               for t, s in zip(sent, scores, strict=True)],
                              np.float32).reshape(len(sent), -1)
        etas = entropy_of_logits(scores)
        return [Exit("cloud", s, float(eta), t.fallback.views)
                for t, s, eta in zip(sent, scores, etas, strict=True)]
