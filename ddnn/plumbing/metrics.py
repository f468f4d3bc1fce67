"""Prometheus metrics for every tier, on the official client library (``prometheus_client``).

A thin layer over it: each service owns a :class:`Registry` (never the library's global one, so
several services in one process, as in the tests, keep their own series), metrics are
updated with labels as keyword arguments (``frames.inc(exit="local", degraded="false")``), and
``value()``/``count()`` read a series back for logs and tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# A ``*_created`` series per labelled counter doubles a scrape for nothing these services use.
prometheus_client.disable_created_metrics()

# The classic text format every Prometheus version scrapes (what generate_latest writes).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Metric:
    def __init__(self, registry: CollectorRegistry, metric, sample: str):
        self._registry, self._metric, self._sample = registry, metric, sample
        self._children: dict[tuple, object] = {}  # label values -> the library's child

    def _series(self, labels: dict[str, str]):
        # Unlabelled metrics are their own series. The children are cached: the edge updates
        # a few labelled series per message, and the library's labels() lookup is not free.
        if not labels:
            return self._metric
        key = tuple(labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._metric.labels(**{k: str(v) for k, v in labels.items()})
            self._children[key] = child
        return child

    def _read(self, suffix: str, labels: dict[str, str]) -> float:
        v = self._registry.get_sample_value(self._sample + suffix,
                                            {k: str(x) for k, x in labels.items()})
        return 0.0 if v is None else v


class Counter(_Metric):
    """A monotonically increasing count, per label set."""

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._series(labels).inc(amount)

    def zero(self, **labels: str) -> None:
        """Export the series at 0 before its first count, so that Prometheus's rate() and
        increase() count that first count too (a series first seen at N counts from N)."""
        self._series(labels)

    def value(self, **labels: str) -> float:
        return self._read("_total", labels)

    def catch_up(self, total: float, **labels: str) -> None:
        """Bring the series up to ``total``, a running count kept elsewhere (a tier's own
        statistics): it counts the difference since the last call. Callers serialize calls on
        one counter (a read, then an increment)."""
        delta = total - self.value(**labels)
        if delta > 0:
            self.inc(delta, **labels)


class Gauge(_Metric):
    """A value that goes up and down."""

    def set(self, value: float, **labels: str) -> None:
        self._series(labels).set(value)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self._series(labels).inc(amount)

    def value(self, **labels: str) -> float:
        return self._read("", labels)

    def get(self, **labels: str) -> float | None:
        """The series' value, or None when it was never set."""
        return self._registry.get_sample_value(self._sample, {k: str(x)
                                                              for k, x in labels.items()})


class Histogram(_Metric):
    """Observations counted into cumulative buckets, with their sum and count."""

    def observe(self, value: float, **labels: str) -> None:
        self._series(labels).observe(value)

    def count(self, **labels: str) -> int:
        return int(self._read("_count", labels))


class Registry:
    """The metrics of one service, rendered together for a scrape."""

    def __init__(self) -> None:
        self._registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        # The library names counters without "_total" and adds it to the sample.
        base = name.removesuffix("_total")
        m = prometheus_client.Counter(base, help, tuple(labels), registry=self._registry)
        return Counter(self._registry, m, base)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        m = prometheus_client.Gauge(name, help, tuple(labels), registry=self._registry)
        return Gauge(self._registry, m, name)

    def histogram(self, name: str, help: str, labels: Sequence[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        m = prometheus_client.Histogram(name, help, tuple(labels), registry=self._registry,
                                        buckets=tuple(buckets))
        return Histogram(self._registry, m, name)

    def render(self) -> str:
        """The text exposition format (what ``GET /metrics`` answers)."""
        return generate_latest(self._registry).decode()
