"""The result fan-out: every answer of the edge to every result sink, in one order.

Each :class:`~ddnn.result.Result` goes to the sinks one result at a time (the MQTT results
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

from ddnn.edge.events import EdgeEvents
from ddnn.edge.sinks import RecentResults, ResultSink
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result

log = logging.getLogger(__name__)

RECENT_RESULTS = 1000  # results kept for GET /v1/results


class ResultFanout:
    """Publishes each result to ``sinks`` and then to the recent results."""

    def __init__(self, sinks: Sequence[ResultSink], events: EdgeEvents,
                 expect: int | None = None, recent: int = RECENT_RESULTS):
        self.recent = RecentResults(recent)
        # The recent results last: the sinks that carry results away come first.
        self.sinks: list[ResultSink] = [*sinks, self.recent]
        self.events, self.expect = events, expect
        self._lock = threading.Lock()  # every sink sees the results in one order
        self.answered = 0
        self.done = threading.Event()  # set after ``expect`` results
        self._failed = LogThrottle()  # a failing sink: one line each

    def start(self) -> None:
        """Before the first result: the sinks that hold a file, a thread or a connection."""
        for sink in self.sinks:
            sink.start()

    def close(self) -> None:
        """After the last result, in reverse order."""
        for sink in reversed(self.sinks):
            sink.close()

    def publish(self, result: Result) -> None:
        """Send one result to every sink."""
        with self._lock:
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
