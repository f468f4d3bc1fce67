"""The edge's sustained ingest rate with 6 views, against the broker's raw message rate.

A publisher process pushes pre-encoded score envelopes of V devices (6 for the default
bundle) for N frames through the broker as fast as QoS 1 allows. Two consumers take the same
stream, one after the other, in this process: a bare paho subscriber that only counts
messages (the baseline: what the broker and paho deliver on this machine), and the edge
aggregator (decode, validate, assemble, local exit, one JSON result per frame published back).
Every frame exits locally (threshold 1.0, all views present), so this measures ingest, not
ONNX Runtime. Beside the rate: the CPU time the consuming process spends per message (steadier
than rates on a shared machine). Then keeping up: the publishers paced, on one schedule, at 0.5
and 0.9 × the raw rate, latency p50/p99 from capture (the publisher sending a view) to the
bare subscriber's receipt, and to the edge's result handed to paho (and from the frame's last
view to that result). A frame's result cannot come before its last view, so the bare
subscriber's latency is also taken per frame at the edge's clock points: from the frame's
first view's capture to its last view's receipt. Medians over repeats; nothing is asserted.
Where the time goes: [latency.md](../latency.md).

    ddnn bench --only edge_ingest [--quick]
"""

from __future__ import annotations

import os
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ddnn import envelope as env
from ddnn.benchmarks.common import percentile, pyplot, write_json
from ddnn.benchmarks.hierarchy_latency import low_latency_broker
from ddnn.bundle import load_bundle
from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.edge.sinks import ResultSink
from ddnn.envelope import MessageType
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.topics import Topics, default_device_ids

DEPLOYMENT = "ingest"


PUBLISHERS = 2  # load generator processes, each publishing for every PUBLISHERS-th device


def publish(broker: str, bundle: Path, frames: int, first: int, part: int = 0,
            deployment: str = DEPLOYMENT, rate: float = 0.0, start_at: float = 0.0) -> None:
    """Publisher process: some devices' score messages for ``frames`` frames, at full speed
    (``rate`` 0) or at ``rate`` messages per second from ``start_at`` (Unix time, the same for
    every publisher: frame n leaves each of them at the same moment); each message is stamped
    with the time it is sent."""
    m = load_bundle(bundle).manifest
    t = Topics(deployment)
    rng = np.random.default_rng(0)
    # Within the bound the bundle records from calibration (the edge refuses larger scores).
    bound = (m.calibration.get("scores") or {}).get("max_abs") or 4.0
    logits = (rng.uniform(-1, 1, size=(m.views, m.num_classes)) * bound).astype(np.float32)
    devices = default_device_ids(m.views)
    msgs = [(t.device(d, "scores"), bytearray(env.encode(env.pack(
        MessageType.SCORES, version=m.version, frame=first + n, tensor=logits[v : v + 1],
        codec=m.codec["scores"]))))
        for n in range(frames) for v, d in enumerate(devices) if v % PUBLISHERS == part]
    # Where each message's capture time goes: stamped at sending.
    msgs = [(topic, env.frame_header(payload)[1], payload) for topic, payload in msgs]
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
    start = max(start_at, time.time())
    time.sleep(max(start - time.time(), 0.0))
    for i, (topic, at, payload) in enumerate(msgs):
        if rate and i % 10 == 0:  # paced: ten messages at a time, on a wall-clock schedule
            time.sleep(max(start + i / rate - time.time(), 0.0))
        # Captured now: latencies run from here.
        payload[at : at + 4] = struct.pack("<I", round(time.time() / env.TICK) % (1 << 32))
        client.publish(topic, bytes(payload), 1)
        if i % 50 == 0:
            client.loop(0)  # read the PUBACKs that opened the in-flight window
    while client._out_messages:  # paho has no public "all acknowledged" accessor
        client.loop(0.01)
    client.disconnect()


class _Publishers:
    """The load generator: PUBLISHERS processes."""

    def __init__(self, broker: str, bundle: Path, frames: int, first: int, deployment: str,
                 rate: float = 0.0):
        code = ("import sys; from pathlib import Path; from ddnn.benchmarks.edge_ingest import "
                "publish; publish(sys.argv[1], Path(sys.argv[2]), *map(int, sys.argv[3:6]), "
                "sys.argv[6], *map(float, sys.argv[7:9]))")
        start_at = time.time() + 3.0  # both connected by then: they start together
        self.procs = [subprocess.Popen([sys.executable, "-c", code, broker, str(bundle),
                                        str(frames), str(first), str(part), deployment,
                                        repr(rate / PUBLISHERS), repr(start_at)],
                                       env={**os.environ, "OMP_NUM_THREADS": "1"})
                      for part in range(PUBLISHERS)]

    def wait(self, timeout: float) -> None:
        for p in self.procs:
            p.wait(timeout)


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _capture_time(payload: bytes) -> float:
    """The capture time of an envelope, read in place."""
    at = env.frame_header(payload)[1]
    return env.capture_time(struct.unpack_from("<I", payload, at)[0], time.time())


def raw_rate(broker: str, bundle: Path, frames: int, views: int, deployment: str,
             rate: float = 0.0) -> tuple[float, dict]:
    """Messages per second a bare subscriber receives from the publishers, the CPU time this
    process spent per message meanwhile (µs), capture to receipt (ms), and per frame its first
    view's capture to its last view's receipt (ms: the same clock points as the edge's capture
    to result, which no edge can answer before its last view)."""
    n_expected = frames * views
    count = [0, 0.0, 0.0]
    cpu = [0.0, 0.0]
    delays: list[float] = []
    first: dict[int, float] = {}  # frame -> its earliest capture (wall clock)
    last: dict[int, float] = {}  # frame -> its last view's receipt (wall clock)
    done = threading.Event()

    def on_message(topic, payload):
        now = time.perf_counter()
        if count[0] == 0:
            count[1], cpu[0] = now, _cpu()
        count[0] += 1
        count[2] = now
        wall, captured, frame = time.time(), _capture_time(payload), env.frame_header(payload)[0]
        delays.append((wall - captured) * 1e3)
        first[frame] = min(first.get(frame, captured), captured)
        last[frame] = wall
        if count[0] >= n_expected:
            cpu[1] = _cpu()
            done.set()

    opts = MqttOptions(subscriptions=[(Topics(deployment).all_devices("scores"), 1)])
    sub = MqttClient(broker, "ingest-raw", opts, on_message=on_message).start()
    sub.wait_subscribed(10)
    time.sleep(0.3)  # let the subscription reach the broker before publishing
    pub = _Publishers(broker, bundle, frames, 0, deployment, rate)
    done.wait(120)
    pub.wait(60)
    sub.stop()
    per_frame = [(last[f] - first[f]) * 1e3 for f in last]
    return (count[0] - 1) / max(count[2] - count[1], 1e-9), {
        "offered_msgs_per_s": rate or None, "cpu_us_per_msg": (cpu[1] - cpu[0]) / n_expected * 1e6,
        "capture_to_receipt_ms": {"p50": percentile(delays, 50), "p99": percentile(delays, 99)},
        "capture_to_frame_ms": {"p50": percentile(per_frame, 50), "p99": percentile(per_frame, 99)}}


class _Clock(ResultSink):
    """When each frame's last message reached the edge and its result left, and its latency
    from capture (the publisher's time of sending its first view) to result."""

    def __init__(self):
        self.last: dict[int, float] = {}
        self.out: dict[int, float] = {}
        self.from_capture: list[float] = []

    def arrived(self, payload: bytes) -> None:
        self.last[env.frame_header(payload)[0]] = time.perf_counter()

    def publish(self, result) -> None:  # the last sink: the MQTT one has had it
        self.out[result.frame] = time.perf_counter()
        self.from_capture.append(result.latency_ms)

    def after_last_view_ms(self) -> list[float]:
        return [(t - self.last[f]) * 1e3 for f, t in self.out.items() if f in self.last]


def edge_rate(broker: str, bundle: Path, frames: int, views: int, deployment: str,
              rate: float = 0.0) -> tuple[float, dict]:
    """Device messages per second the edge turns into results, and its latency meanwhile
    (``rate``: messages per second offered; 0: as fast as the publishers go)."""
    settings = EdgeSettings(bundle=bundle, broker=broker, deployment=deployment,
                            devices=tuple(default_device_ids(views)), local_threshold=1.0,
                            expect_frames=frames, deadline_ms=5000.0)
    clock = _Clock()
    # paho's own window (as ``ddnn edge`` runs): paho walks its whole window of unacknowledged
    # messages at every PUBACK, so a window of 1000 costs more CPU than it saves waiting.
    service = EdgeService.from_settings(settings, sinks=[clock])
    agg = service.aggregator
    first, cpu = [0.0], [0.0]
    orig = agg.ingest.on_message

    def timed(topic, payload):
        if not first[0]:
            first[0], cpu[0] = time.perf_counter(), _cpu()
        clock.arrived(payload)
        return orig(topic, payload)

    agg.ingest.on_message = timed  # the time of each device message
    service.start()
    service.mqtt.wait_subscribed(10)
    time.sleep(0.3)
    pub = _Publishers(broker, bundle, frames, 0, deployment, rate)
    agg.done.wait(120)
    end, cpu_end = time.perf_counter(), _cpu()
    pub.wait(60)
    service.stop()
    m = agg.metrics
    after_last = clock.after_last_view_ms()
    stats = {"offered_msgs_per_s": rate or None, "results": agg.answered,
             "cpu_us_per_msg": (cpu_end - cpu[0]) / (frames * views) * 1e6,
             "dropped": {r: m.dropped.value(reason=r) for r in ("malformed", "late", "duplicate")},
             "local_exits": m.frames.value(exit="local", degraded="false"),
             "last_view_to_result_ms": {"p50": percentile(after_last, 50),
                                        "p99": percentile(after_last, 99)},
             "capture_to_result_ms": {"p50": percentile(clock.from_capture, 50),
                                      "p99": percentile(clock.from_capture, 99)}}
    return (agg.answered * views - 1) / max(end - first[0], 1e-9), stats


LOADS = (0.5, 0.9)  # offered loads, paced, as fractions of the broker's raw rate


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    m = load_bundle(bundle).manifest
    frames = 1000 if quick else 5000
    repeats = 1 if quick else 3
    raw, edge, runs = [], [], []
    broker = low_latency_broker()
    try:
        for i in range(repeats):
            # A deployment per run: the edge's MQTT session is persistent (an edge restart
            # loses nothing), so a topic it subscribed to before would queue the next run's
            # messages for it and inflate the rate.
            r = {"raw": raw_rate(broker.url, bundle, frames, m.views, f"{DEPLOYMENT}{i}-raw")}
            r["edge"] = edge_rate(broker.url, bundle, frames, m.views, f"{DEPLOYMENT}{i}")
            raw.append(r["raw"][0])
            edge.append(r["edge"][0])
            for load in LOADS:  # keeping up: latency from capture at a paced, offered rate
                for who, measure in (("raw", raw_rate), ("edge", edge_rate)):
                    r[f"{who}@{load}"] = measure(broker.url, bundle, frames, m.views,
                                                 f"{DEPLOYMENT}{i}-{who}{load}",
                                                 rate=load * raw[-1])
            runs.append({k: v[1] for k, v in r.items()})
    finally:
        broker.stop()
    result = _report(m.views, frames, repeats, raw, edge, runs)
    write_json(out_dir, "edge_ingest", result)
    _plot(out_dir / "edge_ingest.png", result)
    return result


def _report(views: int, frames: int, repeats: int, raw: list[float], edge: list[float],
            runs: list[dict]) -> dict:
    med = statistics.median
    ratio = med(edge) / med(raw)

    def latency(key: str, what: str) -> dict:
        return {q: med(r[key][what][q] for r in runs) for q in ("p50", "p99")}

    paced = {str(load): {
        "offered_msgs_per_s": med(r[f"edge@{load}"]["offered_msgs_per_s"] for r in runs),
        "raw_capture_to_receipt_ms": latency(f"raw@{load}", "capture_to_receipt_ms"),
        "raw_capture_to_frame_ms": latency(f"raw@{load}", "capture_to_frame_ms"),
        "edge_capture_to_result_ms": latency(f"edge@{load}", "capture_to_result_ms"),
        "edge_last_view_to_result_ms": latency(f"edge@{load}", "last_view_to_result_ms"),
        "edge_cpu_us_per_msg": med(r[f"edge@{load}"]["cpu_us_per_msg"] for r in runs)}
        for load in LOADS}
    p99 = paced["0.9"]["edge_capture_to_result_ms"]["p99"]
    # The edge's p99 over the bare subscriber's, repeat by repeat (one machine state each):
    # per message as received, and per frame at the same clock points (its last view).
    over_bare = {what: med(r["edge@0.9"]["capture_to_result_ms"]["p99"]
                           / r["raw@0.9"][what]["p99"] for r in runs)
                 for what in ("capture_to_receipt_ms", "capture_to_frame_ms")}
    return {
        "benchmark": "edge_ingest", "views": views, "frames": frames, "repeats": repeats,
        "raw_broker_msgs_per_s": med(raw), "edge_msgs_per_s": med(edge),
        "edge_frames_per_s": med(edge) / views, "edge_over_raw": ratio,
        "edge_over_raw_per_repeat": [e / r for e, r in zip(edge, raw, strict=True)],
        # CPU time of the consuming process per message: steadier than rates on a shared machine
        "cpu_us_per_msg": {"raw_subscriber": med(r["raw"]["cpu_us_per_msg"] for r in runs),
                           "edge": med(r["edge"]["cpu_us_per_msg"] for r in runs)},
        "saturated_edge_last_view_to_result_ms": latency("edge", "last_view_to_result_ms"),
        "paced": paced, "raw_runs": raw, "edge_runs": edge, "runs": runs,
        "cpus": os.cpu_count(),
        "ratios": {"edge_over_raw_broker": ratio,
                   "p99_at_0.9x_edge_over_bare_message": over_bare["capture_to_receipt_ms"],
                   "p99_at_0.9x_edge_over_bare_frame": over_bare["capture_to_frame_ms"]},
        "aims": {"edge_0.9x_raw_broker": {"target": 0.9, "measured": ratio, "met": ratio >= 0.9},
                 "p99_at_0.9x_within_2x_bare_frame": {
                     "target": 2.0, "measured": over_bare["capture_to_frame_ms"],
                     "met": over_bare["capture_to_frame_ms"] <= 2.0},
                 "p99_at_0.9x_raw_20ms": {"target": 20.0, "measured": p99, "met": p99 <= 20.0}},
        "note": "publishers, broker and consumer share this machine's cores. Saturated: the "
                "publishers at full speed (rates; the backlog waits in the broker). Paced: a "
                "fraction of the raw rate offered, both publishers on one schedule; latency "
                "from capture (the publisher sending a view) to the bare subscriber's receipt, "
                "or to the edge's result handed to paho (from the frame's first view); the bare "
                "subscriber's per frame: from the frame's first view's capture to its last "
                "view's receipt (the same clock points as the edge's). Medians over the "
                "repeats; the p99 ratios are medians of each repeat's ratio.",
    }


def _plot(path: Path, r: dict) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    fig, (ax, lat) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax.bar(["broker raw", "edge ingest"], [r["raw_broker_msgs_per_s"], r["edge_msgs_per_s"]],
           color=["#999999", "#1f77b4"])
    ax.axhline(0.9 * r["raw_broker_msgs_per_s"], ls="--", color="k", lw=1,
               label="aim: 0.9 × broker raw")
    ax.set_ylabel("device messages / s")
    ax.set_title(f"Saturated, {r['views']} views (QoS 1, loopback)", fontsize=9)
    ax.legend(fontsize=8)
    loads = sorted(r["paced"], key=float)
    x = np.arange(len(loads))
    bars = (("raw_capture_to_receipt_ms", "bare subscriber: each view"),
            ("raw_capture_to_frame_ms", "bare subscriber: frame's last view"),
            ("edge_capture_to_result_ms", "edge: to result"))
    for i, (key, label) in enumerate(bars):
        lat.bar(x + (i - 1) * 0.27, [r["paced"][k][key]["p99"] for k in loads], 0.27,
                label=label, color=["#bbbbbb", "#777777", "#1f77b4"][i])
    lat.axhline(20, ls="--", color="k", lw=1, label="aim: p99 ≤ 20 ms at 0.9×")
    lat.set_xticks(x, [f"{float(k):g} × raw" for k in loads])
    lat.set_yscale("log")
    lat.set_ylabel("p99 from capture (ms)")
    lat.set_title("Paced: offered load vs latency", fontsize=9)
    lat.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
