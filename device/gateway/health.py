"""The gateway's own metrics and health, served on ``--http-port`` like the other processes'.

``GET /metrics`` (Prometheus: batches and messages forwarded, groups sent complete or at
their window's end, messages dropped and refused, each broker's connection, the devices
seen), ``GET /healthz`` = ``/readyz`` (503 with reasons while a broker has been unreachable
for longer than ``--health-grace``, or refused the gateway for good) and ``GET /livez`` (the
threads of its lifecycle run). The service counts in a plain dict (``forwarded``); the
metrics catch up with it at each scrape.
"""

from __future__ import annotations

import threading
import time

from ddnn.plumbing.health import Check, MonitorServer, check_route
from ddnn.plumbing.metrics import CONTENT_TYPE, Registry


class GatewayMetrics:
    """Every series a gateway exports; names start with ``ddnn_gateway_``."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.batches = r.counter("ddnn_gateway_batches_total", "Batches sent up the uplink")
        self.messages = r.counter("ddnn_gateway_messages_total",
                                  "Device messages sent up, in batches")
        self.groups = r.counter("ddnn_gateway_groups_total",
                                "A frame's messages sent together: complete (every device "
                                "expected sent its own) or timed_out (the window ended)",
                                ("outcome",))
        self.dropped = r.counter("ddnn_gateway_dropped_total",
                                 "Device messages dropped: malformed, or too large for a batch")
        self.refused = r.counter("ddnn_gateway_refused_total",
                                 "Device messages in batches the edge's broker refused (they "
                                 "stay on the site's broker)")
        self.broker_up = r.gauge("ddnn_gateway_broker_connected",
                                 "1 while connected, by broker (up: the edge's; local: the "
                                 "site's)", ("broker",))
        self.devices = r.gauge("ddnn_gateway_devices", "Devices whose status the gateway "
                                                       "forwards, by state", ("state",))
        self._lock = threading.Lock()

    def render(self, service) -> str:
        """The series, brought up to date from ``service`` (a GatewayService)."""
        f = dict(service.forwarded)
        with self._lock:
            self.batches.catch_up(f["batches"])
            self.messages.catch_up(f["messages"])
            self.groups.catch_up(f["complete"], outcome="complete")
            self.groups.catch_up(f["timed_out"], outcome="timed_out")
            self.dropped.catch_up(f["dropped"])
            self.refused.catch_up(f["refused"])
            for name, client in (("up", service.up), ("local", service.local)):
                self.broker_up.set(1 if client.connected.is_set() else 0, broker=name)
            states = [s.get("state") for s in list(service.roster.statuses.values())]
            for state in ("online", "offline"):
                self.devices.set(states.count(state), state=state)
        return self.registry.render()


def readiness(service) -> Check:
    """Whether the gateway forwards: both brokers reachable (within the grace), neither
    refusing it."""
    grace, now = service.settings.health_grace, time.monotonic()
    check = Check(details={"forwarded": dict(service.forwarded),
                           "devices": len(service.roster.statuses)})
    for what, client in (("the edge's broker", service.up), ("the site's broker", service.local)):
        if client.refused is not None:
            check.reasons.append(f"{what} refused this gateway for good: {client.refused}")
            continue
        since = client.disconnected_since
        if since is not None and now - since > grace:
            check.reasons.append(f"{what} {client.url} unreachable for {now - since:.0f} s (more "
                                 f"than --health-grace {grace:g} s)"
                                 + client.attempts.last_attempt())
    return check


def monitor(service, host: str, port: int) -> MonitorServer:
    """The gateway's HTTP server: /metrics, /healthz, /readyz, /livez."""
    def scrape() -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE, service.metrics.render(service).encode()

    ready = check_route(lambda: readiness(service))
    return MonitorServer({"/metrics": scrape, "/healthz": ready, "/readyz": ready,
                          "/livez": check_route(service.lifecycle.liveness)}, host, port,
                         name="gateway")
