"""Where the edge's results go: the MQTT results topic, a JSON-lines file, an application's HTTP
callback, and the recent results kept for ``GET /v1/results``.

A sink is a :class:`ResultSink`: ``publish(result)`` for each :class:`~ddnn.result.Result`,
``start()`` before the first and ``close()`` after the last when it holds a file, a thread or a
connection. The aggregator fans each result out to its sinks one result at a time, so every
sink sees the same sequence.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from pathlib import Path

from ddnn.edge.callback import ResultsCallback
from ddnn.result import Result
from ddnn.topics import DELIVERY


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


class RecentResults(ResultSink):
    """The last ``size`` results, for ``GET /v1/results`` and for tests."""

    def __init__(self, size: int = 1000):
        # Results as they are (immutable): made into dicts when read, not for every frame.
        self._ring: collections.deque[Result] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def publish(self, result: Result) -> None:
        with self._lock:
            self._ring.append(result)

    def all(self) -> list[dict]:
        """The kept results, oldest first."""
        with self._lock:
            kept = list(self._ring)
        return [r.to_dict() for r in kept]

    def after(self, frame: int) -> list[dict]:
        """The kept results of frames after ``frame``."""
        return [r for r in self.all() if r["frame"] > frame]
