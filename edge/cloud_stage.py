"""The cloud stage: the frames the edge exit could not answer, sent to the cloud in batches.

A thread of its own takes the frames waiting (at most ``batch``), calls the cloud once per
bundle version among them (during an update frames finish on their own version) over the
Open Inference Protocol (:class:`~ddnn.edge.cloud_client.CloudClient`), and answers each frame
from the cloud's scores. When the cloud cannot answer (none configured, unreachable, broken
scores, a version it does not serve), each frame is answered from the edge's own exit,
flagged ``degraded``: a frame is never lost to the cloud.

An *escalated* frame (``ToCloud.detail``, :mod:`ddnn.edge.escalation`) goes to the cloud's
escalated model with its cameras' details; a cloud that does not serve that model (404) answers
it from the plain cloud segment instead, flagged ``degraded``.

An *audited* frame (``ToCloud.audit``, :mod:`ddnn.edge.audit`) was answered by an early exit
already: the cloud's answer only goes to :meth:`~ddnn.edge.answers.Answers.cloud_answered`,
like every answer the cloud gives (the drift monitor and the experience recorder learn from
them). Every answer goes to the edge's one :class:`~ddnn.edge.answers.Answers`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np

from ddnn.edge.answers import Answers
from ddnn.edge.assembler import DONE, Frame
from ddnn.edge.cloud_client import CloudClient, CloudError, UnknownVersion
from ddnn.edge.events import EdgeEvents
from ddnn.edge.pipeline import ExitPipeline, ToCloud
from ddnn.plumbing.lifecycle import Worker
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger(__name__)


class CloudStage:
    """Frames for the cloud in (:meth:`put`), answers out to ``answers``.

    ``cloud`` None: every frame is answered from the edge exit, degraded.
    """

    def __init__(self, cloud: CloudClient | None, answers: Answers, events: EdgeEvents, *,
                 batch: int):
        self.cloud, self.answers, self.events, self.batch = cloud, answers, events, batch
        # (each frame with its hand-over time: a call's cost counts its oldest frame's queueing)
        self._queue: queue.SimpleQueue[tuple[Frame, ToCloud, float]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._unknown = LogThrottle()  # a version the cloud does not serve: one line each
        self.worker = Worker("edge-cloud", self._loop, stop=self._stop.set)

    @property
    def up(self) -> bool:
        """Whether the cloud answered the last call (False without a cloud)."""
        return bool(self.cloud and self.cloud.up)

    def put(self, f: Frame, sent: ToCloud, since: float | None = None) -> None:
        """Hand a frame over (it runs from here on the stage's thread); ``since``: when it
        was handed over to go up, if earlier (monotonic: before its details were pulled)."""
        self._queue.put((f, sent, time.monotonic() if since is None else since))

    def close(self) -> None:
        """After the thread stopped: the cloud client's connection."""
        if self.cloud is not None:
            self.cloud.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._queue.get(timeout=0.05)]
            except queue.Empty:
                continue
            while len(batch) < self.batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            # One call per bundle version (during an update, frames finish on their own) and
            # model (escalated or not).
            groups: dict[tuple[str, bool], list[tuple[Frame, ToCloud]]] = {}
            for f, sent, _ in batch:
                groups.setdefault((sent.version, sent.detail is not None), []).append((f, sent))
            since = min(t for _, _, t in batch)
            for (version, _), items in groups.items():
                try:
                    self._send(items, version, since)
                except Exception:  # a bug must not lose the frames: the edge's answer stands
                    log.exception("cloud stage failed; answering from the edge exit")
                    for f, sent in items:
                        if f.stage is not DONE:
                            self.answers.answer(f, sent.fallback, step="cloud", degraded=True)

    def _send(self, items: list[tuple[Frame, ToCloud]], version: str, since: float) -> None:
        sent = [s for _, s in items]
        scores, degraded = None, False
        if sent[0].detail is not None:
            scores = self._call(sent, version, since, escalated=True)
            degraded = scores is None  # the plain cloud's answer is the weaker one
        escalated = scores is not None
        if scores is None:
            scores = self._call(sent, version, since)
        if scores is None:  # no cloud: the best answer this edge has is its own, degraded
            for f, s in items:
                if not s.audit:  # (an audited frame has its answer)
                    self.answers.answer(f, s.fallback, step="cloud", degraded=True)
            return
        answers = ExitPipeline.cloud(scores, sent, escalated=escalated)
        # An audit, and the label of the experience recorded, is the cloud's own answer: a
        # stacked one holds the early exits' answers it is to check.
        own = ExitPipeline.cloud(scores, sent, stacked=False)
        for (f, s), answer, checked in zip(items, answers, own, strict=True):
            if not s.audit:
                self.answers.answer(f, answer, step="cloud", degraded=degraded)
            self.answers.cloud_answered(f, s, checked)

    def _call(self, sent: list[ToCloud], version: str, since: float, escalated: bool = False
              ) -> np.ndarray | None:
        """The cloud's scores for ``sent`` (from the escalated model, with the details), or
        None when it cannot give them (counted, with the time since ``since``: the oldest
        frame's hand-over, monotonic)."""
        if self.cloud is None or not self.cloud.available():
            return None
        model = "escalated" if escalated else "cloud"
        features = np.concatenate([s.features for s in sent])
        try:
            if escalated:
                details = [s.detail for s in sent if s.detail is not None]
                scores = self.cloud.infer_escalated(features, np.concatenate(details), version)
            else:  # (the entropy is computed here from the scores)
                scores, _ = self.cloud.infer(features, version, entropy=False)
            classes = len(sent[0].fallback.scores)
            if scores.shape != (len(sent), classes) or not np.isfinite(scores).all():
                raise CloudError(f"cloud answered scores of shape {scores.shape} (expected "
                                 f"{(len(sent), classes)}) or not finite")
        except UnknownVersion as e:
            self.events.on_cloud_call("no_escalated" if escalated else "unknown_version")
            if self._unknown((version, escalated)):  # once per version, not per batch
                log.error("%s; its frames are answered from the %s, degraded", e,
                          "plain cloud segment" if escalated else "edge exit")
            return None
        except CloudError:
            self.events.on_cloud_call("error", time.monotonic() - since, model=model)
            return None
        self.events.on_cloud_call("ok", time.monotonic() - since, model=model)
        return scores
