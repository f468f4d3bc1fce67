"""Devices that stop answering detail pulls, passed over as a silent scorer is.

A device can send its scores and features on time and still never answer the edge's detail
pulls (a bug, an old agent, or on purpose): every escalated frame would then wait out the detail
deadline for it, forever. So a view that missed :data:`SUSPECT_AFTER` detail pulls in a row is
*suspect*: it is flagged (``details``: the metrics' ``ddnn_edge_device_flagged``, ``/healthz``'s
``flagged_devices``) and left out of the pulls, its slot empty, as a missed detail leaves it.
Every :data:`PROBE_EVERY`-th escalated frame that would have asked it asks it again (that frame
waits for it once more), and any detail it sends clears the flag, as any message revives a
silent scorer (:mod:`ddnn.edge.roster`). Not thread-safe: :class:`~ddnn.edge.escalation
.DetailPulls` calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ddnn.edge.events import EdgeEvents

SUSPECT_AFTER = 3  # detail pulls missed in a row before a device is passed over
PROBE_EVERY = 20  # a suspect is asked again on one escalated frame in this many
REASON = "details"  # the flag's reason in metrics and health


class DetailSuspects:
    """Who answers detail pulls, and who is passed over."""

    def __init__(self, devices: Sequence[str], events: EdgeEvents,
                 suspect_after: int = SUSPECT_AFTER, probe_every: int = PROBE_EVERY):
        self.devices, self.events = list(devices), events
        self.suspect_after, self.probe_every = suspect_after, probe_every
        self._misses = [0] * len(self.devices)  # pulls missed in a row, per view
        self._passed = [0] * len(self.devices)  # pulls a suspect was passed over since a probe

    def suspect(self, view: int) -> bool:
        return self._misses[view] >= self.suspect_after

    def ask(self, views: Iterable[int]) -> tuple[int, ...]:
        """Of the views an escalated frame would pull details from, those to ask now: the
        suspects only on their probe."""
        out = []
        for v in views:
            if self.suspect(v):
                self._passed[v] += 1
                if self._passed[v] < self.probe_every:
                    continue
                self._passed[v] = 0
            out.append(v)
        return tuple(out)

    def answered(self, view: int) -> None:
        """``view`` sent a detail it was asked for."""
        was = self.suspect(view)
        self._misses[view] = 0
        if was:
            self.events.on_flag(self.devices[view], REASON, False)

    def missed(self, views: Iterable[int]) -> None:
        """``views`` did not answer a detail pull by its deadline."""
        for v in views:
            self._misses[v] += 1
            if self._misses[v] == self.suspect_after:
                self.events.on_flag(self.devices[v], REASON, True)

    def flagged(self) -> dict[int, list[str]]:
        """The suspects' views, and why (for the health checks)."""
        return {v: [REASON] for v in range(len(self.devices)) if self.suspect(v)}
