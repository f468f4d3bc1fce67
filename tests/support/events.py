"""The edge's events as a test sees them: every ``on_*`` call recorded, in order."""

from __future__ import annotations

import functools
from typing import Any

from ddnn.edge.events import EVENTS, EdgeEvents


class RecordedEvents(EdgeEvents):
    """An observer that keeps every event: ``of("on_flag")`` lists its calls' arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        for name in EVENTS:
            setattr(self, name, functools.partial(self._record, name))

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, *args, *kwargs.values()))

    def of(self, name: str) -> list[tuple[Any, ...]]:
        return [call[1:] for call in self.calls if call[0] == name]
