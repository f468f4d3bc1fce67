"""Where the edge's results go: the MQTT results topic, a JSON-lines file, an application's HTTP
callback, and the recent results kept for ``GET /v1/results``.

A sink is a :class:`ResultSink`: ``publish(result)`` for each :class:`~ddnn.result.Result`,
``start()`` before the first and ``close()`` after the last when it holds a file, a thread or a
connection. The aggregator fans each result out to its sinks one result at a time, so every
sink sees the same sequence.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import json
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ddnn.edge.callback import ResultsCallback
from ddnn.result import Result, ResultError
from ddnn.topics import DELIVERY

log = logging.getLogger(__name__)


class ResultSink:
    """Takes every result the edge answers (a database, a queue: subclass this)."""

    def start(self) -> None:
        """Before the first result."""

    def publish(self, result: Result) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """After the last result."""


class MqttSink(ResultSink):
    """Publishes each result on the deployment's results topic (QoS 1)."""

    def __init__(self, publish: Callable[[str, bytes, int], object], topic: str):
        self._publish, self.topic = publish, topic

    def publish(self, result: Result) -> None:
        self._publish(self.topic, result.to_json(), DELIVERY["results"].qos)


class FileSink(ResultSink):
    """Appends each result as one JSON line to ``path`` (flushed per result)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def publish(self, result: Result) -> None:
        self._file.write(result.to_json().decode() + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class CallbackSink(ResultSink):
    """POSTs each result to an application's URL from a bounded queue
    (:mod:`ddnn.edge.callback`)."""

    def __init__(self, callback: ResultsCallback):
        self.callback = callback

    def start(self) -> None:
        self.callback.start()

    def publish(self, result: Result) -> None:
        self.callback.post(result.to_json())

    def close(self) -> None:
        self.callback.stop()


@dataclass(frozen=True)
class ResultsPage:
    """The answers after a ``seq``, as ``GET /v1/results?since=SEQ`` gives them."""

    results: list[dict]  # in seq order
    oldest: int | None  # the oldest seq kept (None: nothing kept yet)
    latest: int | None  # the newest seq kept
    gap: bool  # answers after ``since`` were dropped from the ring before they were read

    def to_dict(self) -> dict:
        return {"results": self.results, "oldest_seq": self.oldest, "latest_seq": self.latest,
                "gap": self.gap}


class RecentResults(ResultSink):
    """The last ``size`` results, in the order the edge answered them (their ``seq``), for
    ``GET /v1/results`` (and its stream) and for tests."""

    def __init__(self, size: int = 1000):
        # Results as they are (immutable): made into dicts when read, not for every frame.
        self._ring: collections.deque[Result] = collections.deque(maxlen=size)
        self._changed = threading.Condition()  # guards the ring; notified on every result
        # The seq of the newest answer the ring let go (None: none yet). Answer numbers have
        # holes (a restart's jump, the clock start), so only this says what a reader missed.
        self._evicted: int | None = None

    def publish(self, result: Result) -> None:
        with self._changed:
            if len(self._ring) == self._ring.maxlen and self._ring[0].seq is not None:
                self._evicted = self._ring[0].seq
            self._ring.append(result)
            self._changed.notify_all()

    def all(self) -> list[dict]:
        """The kept results, oldest first."""
        with self._changed:
            kept = list(self._ring)
        return [r.to_dict() for r in kept]

    def since(self, seq: int, limit: int | None = None) -> ResultsPage:
        """The kept answers numbered after ``seq``, in seq order: the first ``limit`` of them
        (all without one), and whether some after ``seq`` are no longer kept (``gap``)."""
        with self._changed:
            kept, evicted = list(self._ring), self._evicted
        numbered = [r for r in kept if r.seq is not None]
        start = bisect.bisect_right(numbered, seq, key=_seq)
        page = numbered[start:] if limit is None else numbered[start:start + limit]
        oldest = numbered[0].seq if numbered else None
        latest = numbered[-1].seq if numbered else None
        # A consumer further behind than the ring is told so, never handed a silent gap.
        gap = evicted is not None and seq < evicted
        return ResultsPage([r.to_dict() for r in page], oldest, latest, gap)

    def save(self, path: Path) -> None:
        """Write the kept results to ``path`` (JSON lines, atomically), for :meth:`load`: first
        a line saying the newest seq let go, then the results."""
        with self._changed:
            kept, evicted = list(self._ring), self._evicted
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps({"evicted_seq": evicted}) + "\n")
                f.writelines(r.to_json().decode() + "\n" for r in kept)
            os.replace(tmp, path)
        except OSError as e:  # the results went out already: only a late reader loses them
            log.error("cannot keep the recent results in %s: %s", path, e)

    def load(self, path: Path, below: int) -> None:
        """Take back the results :meth:`save` wrote (those numbered below ``below``, this
        run's first; a line that is not a valid result is skipped)."""
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return
        except (OSError, UnicodeDecodeError) as e:
            log.error("cannot read the recent results in %s: %s", path, e)
            return
        restored, last = [], -1
        evicted = _evicted_seq(lines[0]) if lines else None
        for line in lines[-(self._ring.maxlen or len(lines)):]:
            try:
                r = Result.from_json(line)
            except ResultError:
                continue
            if r.seq is not None and last < r.seq < below:  # (in order, never this run's)
                restored.append(r)
                last = r.seq
        with self._changed:
            self._ring.extendleft(reversed(restored))
            self._evicted = evicted
        if restored:
            log.info("%d recent results of the edge's previous run taken back from %s",
                     len(restored), path)

    def wait_after(self, seq: int, timeout: float) -> bool:
        """Wait until an answer numbered after ``seq`` is kept (True), at most ``timeout``."""
        with self._changed:
            return self._changed.wait_for(
                lambda: bool(self._ring) and (self._ring[-1].seq or 0) > seq, timeout)

    def after(self, frame: int, limit: int | None = None) -> list[dict]:
        """The kept results of frames after ``frame``, in frame order: the first ``limit`` of
        them (all without one). Only those are made into dicts: a page costs its size. (Frames
        are answered out of order: a consumer paging on by frame id misses the frames answered
        after later ones; :meth:`since` pages by answer number and misses none.)"""
        with self._changed:
            kept = [r for r in self._ring if r.frame > frame]
        page = heapq.nsmallest(limit, kept, key=_frame) if limit is not None else sorted(
            kept, key=_frame)
        return [r.to_dict() for r in page]


def _frame(result: Result) -> int:
    return result.frame


def _seq(result: Result) -> int:
    return result.seq or 0


def _evicted_seq(line: str) -> int | None:
    """The first line :meth:`RecentResults.save` writes: the newest seq the ring let go."""
    try:
        value = json.loads(line).get("evicted_seq") if line.startswith("{\"evicted") else None
    except (ValueError, AttributeError):
        return None
    return value if type(value) is int and value >= 0 else None
