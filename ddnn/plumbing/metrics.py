"""Prometheus metrics in the text exposition format, with the standard library alone.

Edge, cloud and device agents expose counters, gauges and histograms at ``/metrics`` (or log
them). Only what these services need is here: labelled series, thread-safe updates, and the
text format that Prometheus scrapes (version 0.0.4).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Iterable, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if not float(x).is_integer() else str(int(x))


class _Metric:
    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    """A monotonically increasing count, per label set."""

    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()):
        super().__init__(name, help, labels)
        self._values: dict[tuple[str, ...], float] = {}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [
            f"{self.name}{_labels(self.label_names, k)} {_num(v)}" for k, v in items
        ]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    kind = "histogram"

    def __init__(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = LATENCY_BUCKETS,
    ):
        super().__init__(name, help, labels)
        self.buckets = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], list] = {}

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._series.setdefault(key, [[0] * (len(self.buckets) + 1), 0.0])
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._series[key][1] = total + value

    def count(self, **labels: str) -> int:
        s = self._series.get(self._key(labels))
        return sum(s[0]) if s else 0

    def render(self) -> list[str]:
        lines = self.header()
        with self._lock:
            items = sorted((k, (list(c), t)) for k, (c, t) in self._series.items())
        for key, (counts, total) in items:
            running = 0
            for bound, c in zip((*self.buckets, math.inf), counts, strict=True):
                running += c
                le = _labels(self.label_names, key, f'le="{_num(bound)}"')
                lines.append(f"{self.name}_bucket{le} {running}")
            lab = _labels(self.label_names, key)
            lines.append(f"{self.name}_sum{lab} {_num(total)}")
            lines.append(f"{self.name}_count{lab} {running}")
        return lines


class Registry:
    """The metrics of one process, rendered together for a scrape."""

    def __init__(self) -> None:
        self._metrics: list[_Metric] = []

    def add(self, metric: _Metric):
        self._metrics.append(metric)
        return metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return self.add(Counter(name, help, labels))

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return self.add(Gauge(name, help, labels))

    def histogram(
        self,
        name: str,
        help: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return self.add(Histogram(name, help, labels, buckets))

    def render(self) -> str:
        lines: list[str] = []
        for m in self._metrics:
            lines += m.render()
        return "\n".join(lines) + "\n"
