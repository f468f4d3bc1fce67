"""The result fan-out: every answer of the edge to every result sink, in one order.

Each :class:`~ddnn.result.Result` is numbered (its ``seq``, :mod:`ddnn.edge.sequence`) and goes
to the sinks one result at a time (the MQTT results
topic, a file, an application's callback, and last the recent results behind
``GET /v1/results``), so every sink sees the same sequence. A sink that fails is counted
(``on_dropped("sink")``: ``ddnn_edge_dropped_total{reason="sink"}``) and logged once, and the
others still get the result. The fan-out counts what it published and says when ``expect``
results are out.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

from ddnn.edge.events import EdgeEvents
from ddnn.edge.sequence import AnswerSequence
from ddnn.edge.sinks import RecentResults, ResultSink
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result

log = logging.getLogger(__name__)

RECENT_RESULTS = 1000  # results kept for GET /v1/results
RECENT_FILE = "recent-results.jsonl"  # in the state directory, across a graceful restart


class ResultFanout:
    """Publishes each result to ``sinks`` and then to the recent results."""

    def __init__(self, sinks: Sequence[ResultSink], events: EdgeEvents,
                 expect: int | None = None, recent: int = RECENT_RESULTS, *,
                 state_dir: Path | None = None):
        self.sequence = AnswerSequence(state_dir)  # numbers each answer (its seq)
        self.recent = RecentResults(recent)
        # The recent results outlive a graceful restart there: a consumer that had not read the
        # last answers of the edge before gets them from the next one.
        self._kept = None if state_dir is None else Path(state_dir) / RECENT_FILE
        # The recent results last: the sinks that carry results away come first.
        self.sinks: list[ResultSink] = [*sinks, self.recent]
        self.events, self.expect = events, expect
        self._lock = threading.Lock()  # every sink sees the results in one order
        self.answered = 0
        self.done = threading.Event()  # set after ``expect`` results
        self._failed = LogThrottle()  # a failing sink: one line each

    def start(self) -> None:
        """Before the first result: the answer numbers, then the sinks that hold a file, a
        thread or a connection."""
        self.sequence.open()
        if self._kept is not None:
            self.recent.load(self._kept, below=self.sequence.first)
        for sink in self.sinks:
            sink.start()

    def close(self) -> None:
        """After the last result, in reverse order (the recent results kept last)."""
        for sink in reversed(self.sinks):
            sink.close()
        if self._kept is not None:
            self.recent.save(self._kept)

    def publish(self, result: Result) -> None:
        """Number one result (its ``seq``: the order of the answers) and send it to every
        sink."""
        with self._lock:
            result = result.numbered(self.sequence.next())
            for sink in self.sinks:
                try:
                    sink.publish(result)
                except Exception:  # a full disk or a broken sink must not silence the others
                    self.events.on_dropped("sink")
                    if self._failed(type(sink).__name__):
                        log.exception("result sink %s failed; counted in "
                                      'ddnn_edge_dropped_total{reason="sink"}',
                                      type(sink).__name__)
            self.answered += 1
            if self.expect and self.answered >= self.expect:
                self.done.set()
