"""The edge's readiness rules, on a stand-in aggregator: a worker with frames pending and no
answer for --stall-after is stalled (not while the broker is away), devices never seen count
as offline only after the grace period, a dead thread fails liveness."""

from __future__ import annotations

import socket
import threading
import time
import types

from ddnn.edge.health import EdgeHealth
from ddnn.edge.settings import EdgeSettings
from tests.support.polling import wait_for
from tests.support.stubs import Agg


def health(tmp_path, mqtt=None, **settings) -> tuple[EdgeHealth, Agg]:
    (tmp_path / "b").mkdir(exist_ok=True)
    s = EdgeSettings(bundle=tmp_path / "b", http_port=0, **settings)
    agg = Agg()
    return EdgeHealth(agg, s, mqtt, liveness=agg.parts.liveness), agg  # type: ignore[arg-type]


def test_pending_frames_without_answers_are_a_stall(tmp_path):
    h, agg = health(tmp_path, stall_after=10)
    agg.assembler[:] = ["frame"]
    h.sample()
    assert h.readiness().ok
    h._progress_at = time.monotonic() - 11  # sampled 11 s ago, no answer since
    h.sample()
    assert any("worker stalled: 1 frames pending" in r for r in h.readiness().reasons)
    agg.answered = 1  # an answer is progress
    h.sample()
    assert h.readiness().ok
    h._progress_at = time.monotonic() - 11
    agg.assembler[:] = []  # nothing pending: nothing to stall
    assert h.stalled_for() == 0 and h.readiness().ok


def test_no_stall_while_the_broker_is_away(tmp_path):
    mqtt = types.SimpleNamespace(connected=threading.Event(), refused=None, url="mqtt://x:1",
                                 disconnected_since=None, alive=lambda: True)
    h, agg = health(tmp_path, mqtt=mqtt, broker="mqtt://x:1", stall_after=1)
    agg.assembler[:] = ["frame"]
    h.sample(now=0.0)
    h.sample(now=100.0)
    assert h._progress_at == 100.0, "deadlines are frozen while the link is down"


def test_devices_never_seen_count_as_offline_after_the_grace(tmp_path):
    mqtt = types.SimpleNamespace(connected=threading.Event(), refused=None, url="mqtt://x:1",
                                 disconnected_since=None, alive=lambda: True)
    mqtt.connected.set()
    h, agg = health(tmp_path, mqtt=mqtt, broker="mqtt://x:1", health_grace=3600)
    assert h.readiness().ok, "a fresh edge waits for its devices"
    h.started -= 7200
    assert any("every device is offline" in r for r in h.readiness().reasons)
    agg.metrics.devices_online.set(1, device="cam1")
    assert h.readiness().ok
    agg.metrics.devices_online.set(0, device="cam1")
    reasons = h.readiness().reasons
    assert reasons == ["every device is offline: cam0 (never seen), cam1 (offline)"]


def test_a_dead_thread_fails_liveness(tmp_path):
    h, agg = health(tmp_path)
    assert h.liveness().ok
    agg.parts.add("edge-worker", alive=lambda: False).start()  # a started thread that ended
    reasons = h.liveness().reasons
    assert "the edge-worker thread is not running" in reasons


def closed_by_peer(s: socket.socket) -> bool:
    """The other end closed ``s`` (a read would return end-of-file at once)."""
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        s.setblocking(True)


def test_the_monitoring_server_caps_its_connections():
    """Idle connections past the cap are closed unanswered: threads stay bounded."""
    from ddnn.plumbing.health import MAX_CONNECTIONS, MonitorServer

    server = MonitorServer({"/livez": lambda: (200, "application/json", b"{}")}).start()
    before = threading.active_count()
    idle = [socket.create_connection((server.host, server.port)) for _ in range(40)]
    try:
        # Each idle client holds a thread until its timeout; the ones past the cap are closed.
        wait_for(lambda: sum(map(closed_by_peer, idle)) >= len(idle) - MAX_CONNECTIONS,
                 what="the server to close the connections past its cap")
        assert threading.active_count() - before <= MAX_CONNECTIONS + 2
    finally:
        for s in idle:
            s.close()
        server.stop()
