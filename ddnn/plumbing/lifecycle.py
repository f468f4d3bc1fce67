"""One lifecycle for every service: parts started in order, stopped in reverse, listed for
``/livez``.

A *part* is anything with ``start()``, ``stop()`` and, when it runs a thread of its own,
``alive()``: an MQTT client, an HTTP server, a bundle updater, a :class:`Worker` thread, or a
nested :class:`Lifecycle`. No constructor starts a thread: a service builds its parts, lists
them in a :class:`Lifecycle`, and the ``with`` block (or ``start``/``stop``) runs them::

    parts = Lifecycle()
    parts.add("mqtt", client)
    parts.add("sender", Worker("device-sender", send_loop, stop=done.set))
    with parts:
        ...
    parts.liveness()  # what /livez answers: a Check naming any part whose thread ended

A part that fails to start stops those started before it, in reverse, and the error goes on.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ddnn.plumbing.health import Check

log = logging.getLogger(__name__)


class Part(Protocol):
    """What a lifecycle runs: ``alive()`` too when the part runs a thread of its own."""

    def start(self) -> object: ...

    def stop(self) -> None: ...


def _nothing() -> None:
    pass


@dataclass
class _Step:
    name: str
    start: Callable[[], object]
    stop: Callable[[], None]
    alive: Callable[[], bool] | None  # None: no thread of its own (not in /livez)
    nested: Lifecycle | None = None


class Worker:
    """A daemon thread of a service: ``run()`` in a thread made and started by :meth:`start`;
    :meth:`stop` calls ``stop()`` (which makes ``run`` return) and waits up to ``join``."""

    def __init__(self, name: str, run: Callable[[], None],
                 stop: Callable[[], None] = _nothing, join: float = 5.0):
        self.name, self._run, self._stop, self._join = name, run, stop, join
        self._thread: threading.Thread | None = None

    def start(self) -> Worker:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop()
        if self._thread is not None:
            self._thread.join(self._join)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class Lifecycle:
    """Parts of one service, started in the order they were added and stopped in reverse."""

    def __init__(self) -> None:
        self._steps: list[_Step] = []
        self._started: list[_Step] = []

    def add(self, name: str, part: object = None, *, start: Callable[[], object] | None = None,
            stop: Callable[[], None] | None = None,
            alive: Callable[[], bool] | None = None) -> Lifecycle:
        """Add ``part`` (its ``start``, ``stop`` and ``alive``, each of which may be given
        instead); ``name`` is what ``/livez`` calls its thread. Returns this lifecycle."""
        nested = part if isinstance(part, Lifecycle) else None
        if alive is None and nested is None:
            alive = getattr(part, "alive", None)
        self._steps.append(_Step(name, start or getattr(part, "start", _nothing),
                                 stop or getattr(part, "stop", _nothing), alive, nested))
        return self

    def start(self) -> Lifecycle:
        """Start every part in order; a failure stops those started, in reverse, and raises."""
        for step in self._steps:
            try:
                step.start()
            except BaseException:
                self.stop()
                raise
            self._started.append(step)
        return self

    def stop(self) -> None:
        """Stop the started parts in reverse order; one that fails to stop is logged, and the
        others still stop."""
        while self._started:
            step = self._started.pop()
            try:
                step.stop()
            except Exception:
                log.exception("stopping %s failed", step.name)

    def threads(self) -> dict[str, bool]:
        """Whether the thread of each started part (nested lifecycles' too) runs."""
        out: dict[str, bool] = {}
        for step in list(self._started):
            if step.nested is not None:
                out.update(step.nested.threads())
            elif step.alive is not None:
                out[step.name] = step.alive()
        return out

    def alive(self) -> bool:
        return all(self.threads().values())

    def liveness(self) -> Check:
        """What ``/livez`` answers: a reason for each started part whose thread has ended."""
        return Check([f"the {name} thread is not running"
                      for name, alive in self.threads().items() if not alive])

    def __enter__(self) -> Lifecycle:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
