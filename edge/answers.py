"""Where a frame's answers go: its result to the sinks, the cloud's answer to learning.

Every exit that answers a frame calls :meth:`Answers.answer` (the frame path at the local and
edge exits, the cloud stage at the cloud): the answer becomes one :class:`~ddnn.result.Result`
(the views fused, and why the others are missing) handed to the
:class:`~ddnn.edge.fanout.ResultFanout`, and the frame is finished in the assembler. Every
answer the cloud gives, audits included, also goes to :meth:`Answers.cloud_answered`: it checks
the early exits (:class:`~ddnn.edge.audit.ExitAudit`) and labels the experience recorded
(:class:`~ddnn.edge.recorder.ExperienceRecorder`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ddnn.edge.assembler import Frame, FrameAssembler
from ddnn.edge.audit import ExitAudit
from ddnn.edge.events import EdgeEvents
from ddnn.edge.fanout import ResultFanout
from ddnn.edge.feedback import AnsweredMemory
from ddnn.edge.pipeline import Exit, ToCloud
from ddnn.edge.recorder import ExperienceRecorder
from ddnn.result import Result, result_for, unanswered


class Answers:
    """Answers frames of ``assembler`` (``devices[i]`` runs view ``i``) through ``fanout``."""

    def __init__(self, assembler: FrameAssembler, devices: Sequence[str], fanout: ResultFanout,
                 events: EdgeEvents, *, audit: ExitAudit,
                 recorder: ExperienceRecorder | None = None,
                 memory: AnsweredMemory | None = None):
        self.assembler, self.devices, self.fanout = assembler, list(devices), fanout
        self.events, self.audit, self.recorder = events, audit, recorder
        self.memory = memory  # the answered frames an operator may label (None: no feedback)

    def answer(self, f: Frame, answer: Exit | None, *, step: str, degraded: bool = False,
               finish: bool = True) -> None:
        """Publish ``answer`` as ``f``'s result (None: no view was fused). ``step``: the stage
        of the latency breakdown that ends here (local, edge or cloud: from the frame's last
        view, its features, or its hand-over to the cloud thread to its result handed to the
        sinks). ``finish`` False: the frame goes on up, answered (an audit,
        :mod:`ddnn.edge.audit`)."""
        latency = max(time.time() - f.captured, 0.0)
        missing = self.assembler.roster.why_missing(f, answer.views if answer else ())
        why = {self.devices[v]: reason for v, reason in missing.items()}
        if answer is None:  # no view was fused: nothing to classify (the result says so)
            result = unanswered(frame=f.id, missing=why, latency_ms=latency * 1000)
        else:
            result = result_for(frame=f.id, scores=answer.scores.tolist(),
                                classes=f.runs_on.classes, exit=answer.tier,
                                entropy=answer.entropy,
                                views=[self.devices[v] for v in answer.views], missing=why,
                                degraded=degraded, latency_ms=latency * 1000)
        self.publish(result)
        handed = time.monotonic()
        # The bookkeeping after the result is out (a bad result leaves the frame unanswered).
        if finish:
            self.assembler.finish(f)
        # Remembered once its answer is out, audited frames too (they go on up to be checked,
        # and the drift an audit finds is what an operator labels).
        if self.memory is not None and f.pipeline is not None:
            self.memory.remember(f.id, f.pipeline.manifest, answer.views if answer else (),
                                 f.features)
        self.events.on_stage(step, handed - f.ready_at)
        self.events.on_answered(result, step, latency)

    def publish(self, result: Result) -> None:
        """Send one result to every sink (the edge's own, or a one-view device's posted over
        HTTP or MQTT)."""
        self.fanout.publish(result)

    def cloud_answered(self, f: Frame, sent: ToCloud, answer: Exit) -> None:
        """The cloud answered a frame (forwarded or audited; ``answer``: its own, not stacked
        on the edge's): it checks the early exits, and labels the experience recorded."""
        self.audit.observe(f, sent, answer)
        if self.memory is not None:  # an audited frame's features, pulled after its answer
            self.memory.add_features(f.id, f.features)
        if self.recorder is not None and f.pipeline is not None:
            self.recorder.put(f.pipeline.manifest,
                              {v: f.features[v] for v in answer.views if v in f.features},
                              f.scores, answer.scores, chance=self._chance(sent))

    def _chance(self, sent: ToCloud) -> float:
        """A frame's chance of being recorded, for a uniform sample of the stream
        (:func:`ddnn.experience.stream_sample`): an audit's rate; 1 for a frame the exits sent
        up, while early exits are audited; 0 where no random draw stands behind it (a latency
        probe, timed and not drawn; any frame while nothing is audited, since the early exits
        then had no chance at all and the frames sent up are only the hard ones)."""
        if sent.probe or not self.audit.on:
            return 0.0
        return sent.audit if sent.audit > 0 else 1.0
