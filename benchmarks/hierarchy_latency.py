"""End-to-end latency per exit tier on loopback, against its floor measured in the same run.

V device processes (``ddnn device``) replay the test set at a modest rate into an edge
(``ddnn edge``) over a Mosquitto (or amqtt) broker, with the cloud (``ddnn cloud``) behind it.
Each result carries its capture-to-result latency; we report p50/p99 per exit tier. The floor
is what no implementation can beat on this machine: the segments' compute on the frame's path
(ONNX Runtime, batch 1, in-process) plus the broker hops on that path (one-way publish→receive
time, measured with a pub/sub ping in the same run) plus, for the cloud tier, the measured
HTTP call. Thresholds are set so that every tier gets frames. Nothing is asserted.

    ddnn bench --only hierarchy_latency [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import pyplot, stop_process, write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.exits import entropy_of_logits
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.runtime import BundleRuntime, transmit
from ddnn.tools.broker import BrokerProcess, free_port, mosquitto_path, start_broker, wait_for_port

TIERS = ("local", "edge", "cloud")


def low_latency_broker() -> BrokerProcess:
    """Mosquitto with ``set_tcp_nodelay true`` (the setting we recommend), else amqtt.

    Mosquitto's default leaves Nagle's algorithm on: a small message queued behind an
    unacknowledged one waits for the receiver's delayed ACK, ~40 ms on Linux, which dominates
    a feature pull's round trip.
    """
    exe = mosquitto_path()
    if exe is None:
        return start_broker(prefer="amqtt")
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="ddnn-bench-broker-"))
    conf = workdir / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                    "set_tcp_nodelay true\nmax_inflight_messages 1000\n"
                    "max_queued_messages 100000\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wait_for_port("127.0.0.1", port, 10, proc)
    return BrokerProcess("mosquitto", "127.0.0.1", port, proc, workdir)


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up: first runs allocate
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def thresholds_for_all_tiers(runtime: BundleRuntime, X, present) -> dict[str, float]:
    """Thresholds at entropy quantiles: ~40 % local, then half of the rest at the edge."""
    ex = runtime.run_dataset(X, present)
    local = entropy_of_logits(ex["local"])
    t_local = float(np.quantile(local, 0.4))
    edge = entropy_of_logits(ex["edge"])[local >= t_local]
    return {"local": t_local, "edge": float(np.quantile(edge, 0.5)) if edge.size else 0.0}


def broker_trip(url: str, payload_size: int, n: int) -> float:
    """Median one-way publish→receive time through the broker (QoS 1), seconds."""
    got = threading.Event()
    box: list[float] = []

    def on_message(topic, payload):
        box.append(time.perf_counter())
        got.set()

    sub = MqttClient(url, "bench-sub", MqttOptions(subscriptions=[("bench/ping", 1)]),
                     on_message=on_message).start()
    pub = MqttClient(url, "bench-pub", MqttOptions()).start()
    sub.wait_connected(10)
    pub.wait_connected(10)
    time.sleep(0.2)  # let the subscription reach the broker (no SUBACK hook in the wrapper)
    trips = []
    for _ in range(n + 5):
        got.clear()
        t0 = time.perf_counter()
        pub.publish("bench/ping", bytes(payload_size), 1)
        if got.wait(2):
            trips.append(box[-1] - t0)
    sub.stop()
    pub.stop()
    return statistics.median(trips[5:])


def floors(runtime: BundleRuntime, X, present, trip: float, cloud_call: float) -> dict:
    """Compute time of each segment at batch 1 and the floor per tier."""
    m = runtime.manifest
    i = int(np.flatnonzero(present.all(axis=1))[0]) if present.all(axis=1).any() else 0
    v = int(np.flatnonzero(present[i])[0])
    reps = 50
    dev = _median_time(lambda: runtime.device(v, X[i : i + 1, v]), reps)
    s, f = runtime.device(v, X[i : i + 1, v])
    scores = np.repeat(transmit(s, runtime.scores_codec)[:, None], m.views, axis=1)
    feats = np.repeat(transmit(f, runtime.device_codec)[:, None], m.views, axis=1)
    mask = np.ones((1, m.views), bool)
    local = _median_time(lambda: runtime.local(scores, mask), reps)
    edge = _median_time(lambda: runtime.edge(feats, mask), reps)
    floor_local = dev + trip + local
    floor_edge = floor_local + 2 * trip + edge  # the pull: a request down, features up
    return {
        "compute_s": {"device": dev, "local": local, "edge": edge},
        "broker_one_way_s": trip, "cloud_call_s": cloud_call,
        "floor_ms": {"local": floor_local * 1e3, "edge": floor_edge * 1e3,
                     "cloud": (floor_edge + cloud_call) * 1e3},
    }


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "ddnn", *args], stdout=f,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)



def _ready(url: str, timeout: float, proc: subprocess.Popen) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.1)  # polling readiness
    return False


def _cloud_call(url: str, model: str, shape: tuple[int, ...], n: int) -> float:
    from ddnn.edge.cloud_client import CloudClient

    client = CloudClient(url, model, timeout=5)
    x = np.ones((1, *shape), np.float32)
    t = _median_time(lambda: client.infer(x), n)
    client.close()
    return t


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    b = load_bundle(bundle)
    m = b.manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    frames = min(len(ds.label), 60 if quick else 300)
    fps = 20.0
    runtime = BundleRuntime(b, threads=1)
    th = thresholds_for_all_tiers(runtime, ds.X[:frames], ds.present[:frames])
    work = Path(tempfile.mkdtemp(prefix="ddnn-bench-latency-"))
    broker = low_latency_broker()
    procs: list[subprocess.Popen] = []
    try:
        cloud_port, http_port = free_port(), free_port()
        cloud_url = f"http://127.0.0.1:{cloud_port}"
        cloud = _start(["cloud", "--bundle", str(bundle), "--host", "127.0.0.1", "--port",
                        str(cloud_port), "--ort-threads", "1"], work / "cloud.log")
        procs.append(cloud)
        cloud_ok = _ready(f"{cloud_url}/v2/health/ready", 60, cloud)
        cloud_shape = m.cloud.inputs[0].sample_shape
        call = _cloud_call(cloud_url, f"{m.name}-cloud", cloud_shape, 30) if cloud_ok else 0.0
        feat_bytes = runtime.device_codec.payload_size(
            (1, *m.devices[0].output("features").sample_shape))
        trip = broker_trip(broker.url, 64 + feat_bytes, 30 if quick else 100)
        floor = floors(runtime, ds.X, ds.present, trip, call)
        results = work / "results.jsonl"
        edge = _start(["edge", "--bundle", str(bundle), "--broker", broker.url, "--cloud",
                       cloud_url, "--deployment", "bench", "--results-out", str(results),
                       "--expect-frames", str(frames), "--http-port", str(http_port),
                       "--local-threshold", repr(th["local"]), "--edge-threshold",
                       repr(th["edge"]), "--deadline-ms", "1000"], work / "edge.log")
        procs.append(edge)
        _ready(f"http://127.0.0.1:{http_port}/healthz", 60, edge)
        # One trigger time for every camera, far enough ahead for the processes to load.
        start_at = time.time() + 3.0 + 1.0 * m.views
        for v in range(m.views):
            procs.append(_start(["device", "--bundle", str(bundle), "--broker", broker.url,
                                 "--view", str(v), "--data", str(data), "--fps", str(fps),
                                 "--limit", str(frames), "--deployment", "bench",
                                 "--wait-peers", "60", "--grace", "1", "--start-at",
                                 repr(start_at)], work / f"device{v}.log"))
        edge.wait(timeout=60 + frames / fps * 3)
        rows = [json.loads(line) for line in results.read_text().splitlines()]
    finally:
        for p in reversed(procs):
            stop_process(p)
        broker.stop()
    lat = {t: [r["latency_ms"] for r in rows if r["exit"] == t and not r["degraded"]]
           for t in TIERS}
    per_tier = {}
    for t in TIERS:
        p50 = _pct(lat[t], 50)
        per_tier[t] = {"frames": len(lat[t]), "p50_ms": p50, "p99_ms": _pct(lat[t], 99),
                       "floor_ms": floor["floor_ms"][t],
                       "p50_over_floor": p50 / floor["floor_ms"][t] if p50 else None}
    result = {
        "benchmark": "hierarchy_latency", "bundle": b.ref, "views": m.views, "frames": frames,
        "answered": len(rows), "fps": fps, "thresholds": th, "cloud": cloud_ok,
        "broker": broker.kind, "per_tier": per_tier, **floor,
        "ratios": {f"{t}_p50_over_floor": per_tier[t]["p50_over_floor"] for t in TIERS
                   if per_tier[t]["p50_ms"] is not None},
        "aims": {"local_p50_within_2x_floor": {
            "target": 2.0, "measured": per_tier["local"]["p50_over_floor"],
            "met": per_tier["local"]["p50_over_floor"] is not None
            and per_tier["local"]["p50_over_floor"] <= 2.0}},
        "note": "latency = capture to result at the edge; floor = segment compute on the "
                "path + broker hops (one-way pub/sub time) + the cloud HTTP call",
    }
    write_json(out_dir, "hierarchy_latency", result)
    _plot(out_dir / "hierarchy_latency.png", per_tier)
    return result


def _plot(path: Path, per_tier: dict) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    tiers = [t for t in TIERS if per_tier[t]["p50_ms"] is not None]
    x = np.arange(len(tiers))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.27, [per_tier[t]["floor_ms"] for t in tiers], 0.27, label="floor")
    ax.bar(x, [per_tier[t]["p50_ms"] for t in tiers], 0.27, label="p50")
    ax.bar(x + 0.27, [per_tier[t]["p99_ms"] for t in tiers], 0.27, label="p99")
    ax.set_xticks(x, tiers)
    ax.set_ylabel("capture → result (ms)")
    ax.set_title("End-to-end latency per exit tier (loopback)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
