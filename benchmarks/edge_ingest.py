"""The edge's sustained ingest rate with 6 views, against the broker's raw message rate.

A publisher process pushes pre-encoded score envelopes of V devices (6 for the default
bundle) for N frames through the broker as fast as QoS 1 allows. Two consumers take the same
stream, one after the other, in this process: a bare paho subscriber that only counts
messages (the baseline: what the broker and paho deliver on this machine), and the edge
aggregator (decode, validate, assemble, local exit, one JSON result per frame published back).
Every frame exits locally (threshold 1.0, all views present), so this measures ingest, not
ONNX Runtime. Rates are medians over repeats; nothing is asserted.

    ddnn bench --only edge_ingest [--quick]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ddnn import envelope as env
from ddnn.benchmarks.common import pyplot, write_json
from ddnn.benchmarks.hierarchy_latency import low_latency_broker
from ddnn.bundle import load_bundle
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.envelope import MessageType
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.topics import Topics, default_device_ids

DEPLOYMENT = "ingest"


PUBLISHERS = 2  # load generator processes, each publishing for every PUBLISHERS-th device


def publish(broker: str, bundle: Path, frames: int, first: int, part: int = 0,
            deployment: str = DEPLOYMENT) -> None:
    """Publisher process: some devices' score messages for ``frames`` frames, at full speed."""
    m = load_bundle(bundle).manifest
    t = Topics(deployment)
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(m.views, m.num_classes)).astype(np.float32) * 4
    devices = default_device_ids(m.views)
    msgs = [(t.device(d, "scores"), env.encode(env.pack(
        MessageType.SCORES, version=m.version, frame=first + n, tensor=logits[v : v + 1], codec=m.codec["scores"])))
        for n in range(frames) for v, d in enumerate(devices) if v % PUBLISHERS == part]
    # paho driven from this one thread (no loop thread): the load generator must cost less
    # than what it measures.
    import paho.mqtt.client as paho

    from ddnn.plumbing.mqtt import BrokerUrl

    url = BrokerUrl.parse(broker)
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=f"ingest-publisher{part}")
    client.max_inflight_messages_set(1000)
    client.connect(url.host, url.port)
    while not client.is_connected():
        client.loop(0.1)
    for i, (topic, payload) in enumerate(msgs):
        client.publish(topic, payload, 1)
        if i % 50 == 0:
            client.loop(0)  # read the PUBACKs that opened the in-flight window
    while client._out_messages:  # paho has no public "all acknowledged" accessor
        client.loop(0.01)
    client.disconnect()


class _Publishers:
    """The load generator: PUBLISHERS processes."""

    def __init__(self, broker: str, bundle: Path, frames: int, first: int, deployment: str):
        code = ("import sys; from pathlib import Path; from benchmarks.edge_ingest import "
                "publish; publish(sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6]), "
                "sys.argv[6])")
        self.procs = [subprocess.Popen([sys.executable, "-c", code, broker, str(bundle),
                                        str(frames), str(first), str(part), deployment],
                                       env={**os.environ, "OMP_NUM_THREADS": "1"})
                      for part in range(PUBLISHERS)]

    def wait(self, timeout: float) -> None:
        for p in self.procs:
            p.wait(timeout)


def raw_rate(broker: str, bundle: Path, frames: int, views: int, deployment: str) -> float:
    """Messages per second a bare subscriber receives from the publisher."""
    n_expected = frames * views
    count = [0, 0.0, 0.0]
    done = threading.Event()

    def on_message(topic, payload):
        now = time.perf_counter()
        if count[0] == 0:
            count[1] = now
        count[0] += 1
        count[2] = now
        if count[0] >= n_expected:
            done.set()

    opts = MqttOptions(subscriptions=[(Topics(deployment).all_devices("scores"), 1)])
    sub = MqttClient(broker, "ingest-raw", opts, on_message=on_message).start()
    sub.wait_connected(10)
    time.sleep(0.3)  # let the subscription reach the broker before publishing
    pub = _Publishers(broker, bundle, frames, 0, deployment)
    done.wait(120)
    pub.wait(60)
    sub.stop()
    return (count[0] - 1) / max(count[2] - count[1], 1e-9)


def edge_rate(broker: str, bundle: Path, frames: int, views: int, deployment: str
              ) -> tuple[float, dict]:
    """Device messages per second the edge turns into results."""
    settings = EdgeSettings(bundle=bundle, broker=broker, deployment=deployment,
                            devices=tuple(default_device_ids(views)), local_threshold=1.0,
                            expect_frames=frames, deadline_ms=5000.0)
    service = EdgeService.from_settings(settings, max_inflight=1000)
    agg = service.aggregator
    first = [0.0]
    orig = agg.ingest.on_message

    def timed(topic, payload):
        if not first[0]:
            first[0] = time.perf_counter()
        return orig(topic, payload)

    agg.ingest.on_message = timed  # the time of the first device message
    service.start()
    service.mqtt.wait_connected(10)
    time.sleep(0.3)
    pub = _Publishers(broker, bundle, frames, 0, deployment)
    agg.done.wait(120)
    end = time.perf_counter()
    pub.wait(60)
    service.stop()
    m = agg.metrics
    stats = {"results": agg.answered,
             "dropped": {r: m.dropped.value(reason=r) for r in ("malformed", "late", "duplicate")},
             "local_exits": m.frames.value(exit="local", degraded="false")}
    return (agg.answered * views - 1) / max(end - first[0], 1e-9), stats


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = load_bundle(bundle).manifest
    frames = 1000 if quick else 5000
    repeats = 1 if quick else 3
    raw, edge, stats = [], [], {}
    broker = low_latency_broker()
    try:
        for i in range(repeats):
            # A deployment per run: the edge's MQTT session is persistent (an edge restart
            # loses nothing), so a topic it subscribed to before would queue the next run's
            # messages for it and inflate the rate.
            raw.append(raw_rate(broker.url, bundle, frames, m.views, f"{DEPLOYMENT}{i}-raw"))
            rate, stats = edge_rate(broker.url, bundle, frames, m.views, f"{DEPLOYMENT}{i}")
            edge.append(rate)
    finally:
        broker.stop()
    result = {
        "benchmark": "edge_ingest", "views": m.views, "frames": frames, "repeats": repeats,
        "raw_broker_msgs_per_s": statistics.median(raw),
        "edge_msgs_per_s": statistics.median(edge),
        "edge_frames_per_s": statistics.median(edge) / m.views,
        "edge_over_raw": statistics.median(edge) / statistics.median(raw),
        "raw_runs": raw, "edge_runs": edge, "last_edge_run": stats, "cpus": os.cpu_count(),
        "ratios": {"edge_over_raw_broker": statistics.median(edge) / statistics.median(raw)},
        "aims": {"edge_3000_msgs_per_s": {"target": 3000, "measured": statistics.median(edge),
                                          "met": statistics.median(edge) >= 3000}},
        "note": "publisher, broker and consumer share this machine's cores",
    }
    write_json(out_dir, "edge_ingest", result)
    _plot(out_dir / "edge_ingest.png", result)
    return result


def _plot(path: Path, r: dict) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(["broker raw", "edge ingest"], [r["raw_broker_msgs_per_s"], r["edge_msgs_per_s"]],
           color=["#999999", "#1f77b4"])
    ax.axhline(3000, ls="--", color="k", lw=1, label="aim: 3000 msg/s")
    ax.set_ylabel("device messages / s")
    ax.set_title(f"Edge ingest with {r['views']} views (QoS 1, loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
