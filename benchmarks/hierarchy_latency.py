"""End-to-end latency per exit tier on loopback, against its floor measured in the same run,
and where the time goes: [latency.md](../latency.md).

V device processes (``ddnn device``) replay the test set at a modest rate into an edge
(``ddnn edge``) over a Mosquitto (or amqtt) broker, with the cloud (``ddnn cloud``) behind it.
Each result carries its capture-to-result latency; we report p50/p99 per exit tier. The floor
is what no implementation can beat on this machine: the segments' compute on the frame's path
(ONNX Runtime, batch 1, in-process) plus the broker hops on that path (one-way publish→receive
time, measured with a pub/sub ping in the same run) plus the measured arrival spread of the
views (first to last view of a frame at a subscriber beside the edge), plus, for the cloud
tier, the measured HTTP call. Thresholds are set so that every tier gets frames.

The breakdown: that subscriber timestamps every view and every result as the broker hands
them out; the edge's ``ddnn_edge_stage_seconds`` histogram (scraped at the end) says what it
added after a frame's last view (local exit), its pull, edge exit and cloud call. Nothing is
asserted.

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

from ddnn import envelope as env
from ddnn.benchmarks.common import percentile, pyplot, stop_process, write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.exits import entropy_of_logits
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.runtime import BundleRuntime, transmit
from ddnn.tools.broker import BrokerProcess, free_port, mosquitto_path, start_broker, wait_for_port
from ddnn.topics import Topics

TIERS = ("local", "edge", "cloud")
DEPLOYMENT = "bench"
# The edge's stages (ddnn_edge_stage_seconds) on each tier's path after the last view.
EDGE_STAGES = {"local": ("local",), "edge": ("pull", "edge"), "cloud": ("pull", "edge", "cloud")}
STAGE_NAMES = {"local": "edge: local exit", "pull": "edge: feature pull",
               "edge": "edge: edge exit", "cloud": "edge: cloud call"}


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
    sub.wait_subscribed(10)
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


class Watcher:
    """A subscriber beside the edge: when each view and each result left the broker."""

    def __init__(self, url: str, deployment: str = DEPLOYMENT):
        t = Topics(deployment)
        self.results_topic = t.results
        self.views: dict[int, list[tuple[float, float]]] = {}  # frame -> [(captured, arrived)]
        self.results: dict[int, tuple[dict, float]] = {}  # frame -> (result, arrived)
        opts = MqttOptions(subscriptions=[(t.all_devices("scores"), 1), (t.results, 1)])
        self.client = MqttClient(url, "bench-watcher", opts, on_message=self._on_message)

    def _on_message(self, topic: str, payload: bytes) -> None:
        now = time.time()
        if topic == self.results_topic:
            r = json.loads(payload)
            self.results[r["frame"]] = (r, now)
            return
        try:
            e = env.decode(payload, now)
        except env.DecodeError:
            return
        self.views.setdefault(e.frame, []).append((e.timestamp, now))

    def frames(self) -> dict[str, list[dict[str, float]]]:
        """Per exit tier, each answered frame's times (ms): capture to its first view at the
        broker's subscribers, first to last view, the edge's last view to its result handed
        to paho (from the result's own latency), the result's hop, and capture to result."""
        out: dict[str, list[dict[str, float]]] = {t: [] for t in TIERS}
        for frame, (r, received) in self.results.items():
            views = self.views.get(frame)
            if not views or r["degraded"]:
                continue
            captured = min(c for c, _ in views)
            first, last = min(a for _, a in views), max(a for _, a in views)
            handed = captured + r["latency_ms"] / 1e3  # the edge stamps it as it answers
            out[r["exit"]].append({
                "arrival": first - captured, "wait": last - first, "edge": handed - last,
                "result": received - handed, "total": received - captured})
        return {t: [{k: v * 1e3 for k, v in row.items()} for row in rows]
                for t, rows in out.items()}


def histogram_quantiles(text: str, name: str, label: str) -> dict[str, dict[str, float]]:
    """p50, p99 and mean (ms) of each series of a Prometheus histogram, by ``label``: linear
    within a bucket, as PromQL's histogram_quantile."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            key = sample.labels.get(label)
            if sample.name.endswith("_bucket"):
                buckets.setdefault(key, []).append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                sums[key] = sample.value
    out = {}
    for key, bs in buckets.items():
        bs.sort()
        total = bs[-1][1]
        if not total:
            continue

        def q(p: float, bs=bs, total=total) -> float:
            rank, low, below = p * total, 0.0, 0.0
            for le, cum in bs:
                if cum >= rank:
                    if le == float("inf"):
                        return low * 1e3
                    return (low + (le - low) * (rank - below) / max(cum - below, 1e-12)) * 1e3
                low, below = le, cum
            return low * 1e3

        out[key] = {"p50": q(0.5), "p99": q(0.99), "mean": sums.get(key, 0.0) / total * 1e3,
                    "count": total}
    return out


def breakdown(watcher: Watcher, stages: dict, compute: dict, trip: float) -> dict:
    """The p50 (ms) of each step of capture to result, per exit tier."""
    out = {}
    for tier, rows in watcher.frames().items():
        if not rows:
            continue
        p50 = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
        device, broker = compute["device"] * 1e3, trip * 1e3
        steps = {"device compute": device,
                 "device publish": max(p50["arrival"] - device - broker, 0.0),
                 "broker": broker, "edge wait for the last view": p50["wait"]}
        for stage in EDGE_STAGES[tier]:
            if stage in stages:
                steps[STAGE_NAMES[stage]] = stages[stage]["p50"]
        steps["result publish"] = p50["result"]
        out[tier] = {"frames": len(rows), "steps_p50_ms": steps,
                     "capture_to_result_at_subscriber_p50_ms": p50["total"],
                     "edge_after_last_view_p50_ms": p50["edge"],
                     "arrival_spread_p50_ms": p50["wait"]}
    return out


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


def _hierarchy(bundle: Path, data: Path, frames: int, fps: float, th: dict, broker_url: str,
               cloud_url: str, work: Path, procs: list) -> tuple[list[dict], Watcher, str]:
    """Run the edge and the devices until every frame is answered: the results, the watcher,
    and the edge's metrics at the end."""
    m = load_bundle(bundle).manifest
    http_port = free_port()
    # Results come from the watcher (MQTT, as an application gets them): no results file on
    # the edge's path.
    edge = _start(["edge", "--bundle", str(bundle), "--broker", broker_url, "--cloud",
                   cloud_url, "--deployment", DEPLOYMENT,
                   "--http-port", str(http_port), "--local-threshold", repr(th["local"]),
                   "--edge-threshold", repr(th["edge"]), "--deadline-ms", "1000"],
                  work / "edge.log")
    procs.append(edge)
    _ready(f"http://127.0.0.1:{http_port}/healthz", 60, edge)
    watcher = Watcher(broker_url)
    watcher.client.start()
    watcher.client.wait_connected(10)
    try:
        # One trigger time for every camera, far enough ahead for the processes to load.
        start_at = time.time() + 3.0 + 1.0 * m.views
        for v in range(m.views):
            procs.append(_start(["device", "--bundle", str(bundle), "--broker", broker_url,
                                 "--view", str(v), "--data", str(data), "--fps", str(fps),
                                 "--limit", str(frames), "--deployment", DEPLOYMENT,
                                 "--wait-peers", "60", "--grace", "1", "--start-at",
                                 repr(start_at)], work / f"device{v}.log"))
        deadline = time.monotonic() + 60 + frames / fps * 3
        while len(watcher.results) < frames and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the watcher: results come on its MQTT thread
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5) as r:
            metrics = r.read().decode()
    finally:
        watcher.client.stop()
    return [r for r, _ in watcher.results.values()], watcher, metrics


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
        cloud_port = free_port()
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
        rows, watcher, metrics = _hierarchy(bundle, data, frames, fps, th, broker.url,
                                            cloud_url, work, procs)
    finally:
        for p in reversed(procs):  # devices, then the edge (it drains on SIGTERM), the cloud
            stop_process(p)
        broker.stop()
    stages = histogram_quantiles(metrics, "ddnn_edge_stage_seconds", "stage")
    steps = breakdown(watcher, stages, floor["compute_s"], trip)
    spread = steps.get("local", {}).get("arrival_spread_p50_ms", 0.0)
    floor["arrival_spread_ms"] = spread
    floor["floor_ms"] = {t: v + spread for t, v in floor["floor_ms"].items()}
    return _report(out_dir, b.ref, m.views, frames, fps, th, cloud_ok, broker.kind, rows,
                   floor, stages, steps)


def _report(out_dir: Path, ref: str, views: int, frames: int, fps: float, th: dict,
            cloud_ok: bool, broker: str, rows: list[dict], floor: dict, stages: dict,
            steps: dict) -> dict:
    lat = {t: [r["latency_ms"] for r in rows if r["exit"] == t and not r["degraded"]]
           for t in TIERS}
    per_tier = {}
    for t in TIERS:
        p50 = percentile(lat[t], 50)
        per_tier[t] = {"frames": len(lat[t]), "p50_ms": p50, "p99_ms": percentile(lat[t], 99),
                       "floor_ms": floor["floor_ms"][t],
                       "p50_over_floor": p50 / floor["floor_ms"][t] if p50 else None}
    local = per_tier["local"]["p50_over_floor"]
    added = stages.get("local", {}).get("p50")
    result = {
        "benchmark": "hierarchy_latency", "bundle": ref, "views": views, "frames": frames,
        "answered": len(rows), "fps": fps, "thresholds": th, "cloud": cloud_ok,
        "broker": broker, "per_tier": per_tier, **floor,
        "edge_stages_ms": stages, "breakdown": steps,
        "ratios": {f"{t}_p50_over_floor": per_tier[t]["p50_over_floor"] for t in TIERS
                   if per_tier[t]["p50_ms"] is not None},
        "aims": {"local_p50_within_2x_floor": {"target": 2.0, "measured": local,
                                               "met": local is not None and local <= 2.0},
                 "edge_adds_at_most_0.3ms_p50_after_last_view": {
                     "target": 0.3, "measured": added,
                     "met": added is not None and added <= 0.3}},
        "note": "latency = capture to result at the edge; floor = segment compute on the "
                "path + broker hops (one-way pub/sub time) + the arrival spread of the views "
                "+ the cloud HTTP call; edge stages: the edge's ddnn_edge_stage_seconds, "
                "quantiles interpolated within its buckets",
    }
    write_json(out_dir, "hierarchy_latency", result)
    _plot(out_dir / "hierarchy_latency.png", per_tier)
    _plot_breakdown(out_dir / "hierarchy_latency_breakdown.png", steps)
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


def _plot_breakdown(path: Path, steps: dict) -> None:
    """Stacked p50 of each step of capture to result, per exit tier."""
    try:
        plt = pyplot()
    except ImportError:
        return
    tiers = [t for t in TIERS if t in steps]
    names = list(dict.fromkeys(k for t in tiers for k in steps[t]["steps_p50_ms"]))
    names.sort(key=lambda name: name == "result publish")  # the last step on every path
    fig, ax = plt.subplots(figsize=(9, 3.4))
    left = np.zeros(len(tiers))
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(names):
        widths = np.array([steps[t]["steps_p50_ms"].get(name, 0.0) for t in tiers])
        ax.barh(tiers, widths, left=left, label=name, color=colors(i % 10))
        left += widths
    ax.invert_yaxis()
    ax.set_xlabel("p50 per step (ms), capture → result at an application")
    ax.set_title("Where a frame's time goes (loopback)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
