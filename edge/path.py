"""The exits a ready frame walks, in one sequence: local exit, feature pull, edge exit, cloud.

:meth:`FramePath.advance` takes a frame as far up as it can go now, and reads top-down:

1. **local exit** (:meth:`ExitPipeline.local`): no view sent scores, answer that nobody saw
   it; confident, answer (:meth:`Answers.answer`), unless the audit draws it
   (:class:`~ddnn.edge.audit.ExitAudit`: answered, and sent on up to be checked) or the latency
   planner probes the paths up with it (:class:`~ddnn.edge.planner.LatencyPlanner`: the same);
2. **pull** the features of the views present (:meth:`FeaturePulls.request`): the frame waits
   in the assembler, which hands it back (through the scheduler) when they are in or at their
   deadline;
3. **edge exit** (:meth:`ExitPipeline.edge`): no features came, the local answer stands,
   degraded; confident, answer;
4. **cloud**: what the edge exit leaves, and audits, go up (:meth:`DetailPulls.send_up`: with
   the cameras' details where the bundle escalates) to the
   :class:`~ddnn.edge.cloud_stage.CloudStage`, which answers through the same
   :class:`~ddnn.edge.answers.Answers`.

The frame's :class:`~ddnn.edge.frame.Stage` says where it resumes. Where and when a frame runs
(at once, or batched on the worker) is the scheduler's (:mod:`ddnn.edge.scheduler`).
"""

from __future__ import annotations

import time
from dataclasses import replace

from ddnn.edge.answers import Answers
from ddnn.edge.assembler import SCORES, Frame, FrameAssembler
from ddnn.edge.audit import ExitAudit
from ddnn.edge.escalation import DetailPulls
from ddnn.edge.events import EdgeEvents
from ddnn.edge.pipeline import Exit, ExitPipeline, Pull
from ddnn.edge.planner import LatencyPlanner
from ddnn.edge.pulls import FeaturePulls


class FramePath:
    """Walks frames of ``assembler`` up the exits of ``pipeline`` (the bundle version new
    frames take: :attr:`pipeline`, replaced by an update; a frame keeps the one it started on).

    ``pulls`` None: the devices push their features (nobody is asked). :attr:`planner`: the
    latency planner, whose probes go up like audits (None: no ``--latency-slo``).
    """

    planner: LatencyPlanner | None = None

    def __init__(self, assembler: FrameAssembler, pipeline: ExitPipeline, answers: Answers,
                 details: DetailPulls, events: EdgeEvents, *, audit: ExitAudit,
                 pulls: FeaturePulls | None = None):
        self.assembler, self.pipeline, self.answers = assembler, pipeline, answers
        self.details, self.events, self.audit, self.pulls = details, events, audit, pulls

    def pin(self, f: Frame) -> ExitPipeline:
        """The pipeline ``f`` runs on: the one new frames take when it first runs, then that
        one, even across an update."""
        if f.pipeline is None:
            f.pipeline = self.pipeline
        return f.pipeline

    def pushing(self) -> set[int]:
        """Views whose devices push their features (never asked for them)."""
        return {v for v, push in enumerate(self.assembler.roster.pushing) if push}

    def local_many(self, frames: list[Frame]) -> dict[int, Exit | Pull]:
        """The local exits of frames at their scores, in one call per bundle version."""
        groups: dict[int, list[Frame]] = {}
        for f in frames:
            groups.setdefault(id(self.pin(f)), []).append(f)
        pushing, out = self.pushing(), dict[int, Exit | Pull]()
        for group in groups.values():
            # (a frame's views are frozen while it is taken: its own dicts are passed)
            decisions = group[0].runs_on.local_many([f.scores for f in group],
                                                    arrived=[f.features for f in group],
                                                    pushing=pushing)
            out.update((f.id, d) for f, d in zip(group, decisions, strict=True))
        return out

    def advance(self, f: Frame, local: Exit | Pull | None = None) -> None:
        """Take a ready frame as far up the exits as it can go now (``local``: its local exit,
        when computed in a batch)."""
        if f.missing:
            self.events.on_missing(f.stage.value, len(f.missing))
        p = self.pin(f)
        if f.stage is SCORES and not self._at_local_exit(f, p, local):
            return  # answered at the local exit, or waiting for its features
        self._at_edge_exit(f, p)

    def _at_local_exit(self, f: Frame, p: ExitPipeline, local: Exit | Pull | None) -> bool:
        """The local exit, then the pull; True: the frame goes on to the edge exit now (its
        features are here already)."""
        if not f.scores:
            # No view sent scores (every camera saw nothing, or none came in time): a class
            # made from nothing would be a wrong answer, so the result says nobody saw it.
            self.answers.answer(f, None, step="local")
            self._observe_arrival(f)
            return False
        if local is None:
            local = p.local(f.scores, arrived=f.features, pushing=self.pushing())
        audited = self.audit.local(f, local) or (
            isinstance(local, Exit) and self.planner is not None and self.planner.probe(f))
        if isinstance(local, Exit) and not audited:
            self.answers.answer(f, local, step="local")
            self._observe_arrival(f)  # (after the result: it is not on the frame's path)
            return False
        if isinstance(local, Exit):  # an audit or a probe: answered once, from here, sent up
            self.answers.answer(f, local, step="local", finish=False)
            pushing = self.pushing()
            local = Pull(local.views, tuple(v for v in local.views if v not in f.features
                                            and v not in pushing), local)
        f.local = local.answer
        # The frame waits for features before the pull goes out, so an answer that comes
        # back at once finds it waiting.
        ready = self.assembler.await_features(f, list(local.views), time.monotonic())
        if local.ask and self.pulls is not None:
            self.pulls.request(f.id, local.ask)
        self._observe_arrival(f)
        return ready is not None  # (None: the features come to the ingest, which hands it back)

    def _at_edge_exit(self, f: Frame, p: ExitPipeline) -> None:
        """The edge exit over the features that came; the cloud for what it leaves, and for
        audits."""
        if f.pulled_at:  # (a one-view device's frame comes with its features)
            self.events.on_stage("pull", f.ready_at - f.pulled_at)
        arrived = {v: f.features[v] for v in f.requested if v in f.features}
        # The local exit answered it: the audit's chance (or the probes' share).
        audited = self.audit.answered(f)
        probed = self.planner.probed(f) if self.planner else 0.0
        early = audited or probed
        if not arrived:
            if early:
                self.assembler.finish(f)  # answered already, and nothing came to check it with
            else:
                # Never classify zeros: no view's features came, so the local exit's answer
                # stands, flagged degraded (the devices could not deliver what it needed).
                self.answers.answer(f, f.local, step="edge", degraded=True)
            return
        edge = p.edge(arrived, audit=early or self.audit.edge(f),
                      below=f.local.scores if f.local is not None else None)
        if isinstance(edge, Exit):
            self.answers.answer(f, edge, step="edge")
        elif early:  # answered at the local exit: the cloud's answer only checks it
            self.assembler.finish(f)
            self.details.send_up(f, replace(edge, audit=early, probe=not audited))
        elif edge.audit:  # answered here, and sent up to be checked
            self.answers.answer(f, edge.fallback, step="edge")
            self.audit.sent(edge)
            self.details.send_up(f, edge)
        else:
            self.events.on_stage("edge", time.monotonic() - f.ready_at)
            f.ready_at = time.monotonic()  # the cloud stage runs from here
            self.details.send_up(f, edge)

    def _observe_arrival(self, f: Frame) -> None:
        """Capture to the frame's first view here (wall clocks), and on to its last view."""
        now = time.monotonic()
        first_wall = time.time() - (now - f.first_at)
        self.events.on_stage("arrival", max(first_wall - f.captured, 0.0))
        self.events.on_stage("wait", f.ready_at - f.first_at)

