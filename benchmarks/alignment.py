"""What frame alignment costs and buys under skew and load: the fixed deadline against the
adaptive edge, in one run.

The scenario of a user following the README on a shared gateway: one ``ddnn device`` process
per view started a second apart, while two CPU-bound processes compete for the cores. Three
configurations run one after another on the same bundle, data and machine:

* ``fixed``: the behaviour before: no agreed start (``--wait-peers 0``), and the edge waits a
  fixed 200 ms after a frame's first view (``--max-wait-ms 200``);
* ``adaptive``: the same skewed starts; the edge learns each device's lag and waits up to
  ``--max-wait-ms 1000``;
* ``agreed``: the defaults: devices agree on one start through the broker, adaptive edge.

Per configuration: the share of answers fused from fewer views than the devices reported
(``partial``), the live accuracy against ``ddnn evaluate`` on the same frames, and the
local-exit latency p50/p99 (capture to result). Nothing is asserted.

    ddnn bench --only alignment [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import percentile, pyplot, stop_process, write_json
from ddnn.benchmarks.hierarchy_latency import (
    _ready,
    _start,
    low_latency_broker,
    thresholds_for_all_tiers,
)
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.hierarchy import hierarchy_predictions
from ddnn.runtime import BundleRuntime
from ddnn.tools.broker import free_port

CONFIGS = {  # name -> (extra edge flags, extra device flags)
    "fixed": (["--max-wait-ms", "200"], ["--wait-peers", "0"]),
    "adaptive": (["--max-wait-ms", "1000"], ["--wait-peers", "0"]),
    "agreed": (["--max-wait-ms", "1000"], []),
}
FPS = 20.0
SKEW_S = 1.0  # seconds between device starts


def _one_run(name: str, work: Path, bundle: Path, data: Path, frames: int, thresholds: dict,
             broker_url: str, cloud_url: str) -> list[dict]:
    edge_flags, device_flags = CONFIGS[name]
    results, port = work / f"{name}.jsonl", free_port()
    m = load_bundle(bundle).manifest
    procs = []
    try:
        edge = _start(["edge", "--bundle", str(bundle), "--broker", broker_url, "--cloud",
                       cloud_url, "--deployment", f"align-{name}", "--results-out",
                       str(results), "--expect-frames", str(frames), "--http-port", str(port),
                       "--local-threshold", repr(thresholds["local"]), "--edge-threshold",
                       repr(thresholds["edge"]), "--deadline-ms", "200", *edge_flags],
                      work / f"{name}-edge.log")
        procs.append(edge)
        _ready(f"http://127.0.0.1:{port}/healthz", 60, edge)
        for v in range(m.views):
            procs.append(_start(["device", "--bundle", str(bundle), "--broker", broker_url,
                                 "--view", str(v), "--data", str(data), "--fps", str(FPS),
                                 "--limit", str(frames), "--deployment", f"align-{name}",
                                 "--grace", "1", *device_flags], work / f"{name}-device{v}.log"))
            time.sleep(SKEW_S)  # the skew under test: devices started one after another
        edge.wait(timeout=120 + frames / FPS * 3)
    except subprocess.TimeoutExpired:
        pass  # reported as fewer answers
    finally:
        for p in reversed(procs):
            stop_process(p)
    if not results.exists():
        return []
    return [json.loads(line) for line in results.read_text().splitlines()]


def _summary(rows: list[dict], offline: np.ndarray, labels: np.ndarray, frames: int) -> dict:
    by_frame = {r["frame"]: r for r in rows if r["frame"] < frames}
    answered = sorted(by_frame)
    live = np.array([by_frame[f]["class"] for f in answered])
    idx = np.array(answered, dtype=int)
    local = [by_frame[f]["latency_ms"] for f in answered if by_frame[f]["exit"] == "local"]
    return {
        "answered": len(answered),
        "partial_share": sum(by_frame[f]["partial"] for f in answered) / max(len(answered), 1),
        "live_accuracy": float((live == labels[idx]).mean()) if answered else None,
        "offline_accuracy": float((offline[idx] == labels[idx]).mean()) if answered else None,
        "local_p50_ms": percentile(local, 50), "local_p99_ms": percentile(local, 99),
    }


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    b = load_bundle(bundle)
    ds = load_dataset(data, num_classes=b.manifest.num_classes)
    frames = min(len(ds.label), 80 if quick else 300)
    runtime = BundleRuntime(b, threads=1)
    th = thresholds_for_all_tiers(runtime, ds.X[:frames], ds.present[:frames])
    exits = runtime.run_dataset(ds.X[:frames], ds.present[:frames])
    offline, _ = hierarchy_predictions(exits, b.manifest.policy.with_overrides(**th))
    work = Path(tempfile.mkdtemp(prefix="ddnn-bench-align-"))
    broker = low_latency_broker()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    cloud = None
    try:
        cloud_port = free_port()
        cloud_url = f"http://127.0.0.1:{cloud_port}"
        cloud = _start(["cloud", "--bundle", str(bundle), "--host", "127.0.0.1", "--port",
                        str(cloud_port), "--ort-threads", "1"], work / "cloud.log")
        _ready(f"{cloud_url}/v2/health/ready", 60, cloud)
        per_config = {}
        for name in CONFIGS:
            rows = _one_run(name, work, bundle, data, frames, th, broker.url, cloud_url)
            per_config[name] = _summary(rows, offline, ds.label[:frames], frames)
    finally:
        for p in burners:
            p.kill()
            p.wait()
        if cloud is not None:
            stop_process(cloud)
        broker.stop()
    fixed, agreed = per_config["fixed"], per_config["agreed"]
    result = {
        "benchmark": "alignment", "bundle": b.ref, "views": b.manifest.views, "frames": frames,
        "fps": FPS, "skew_s": SKEW_S, "cpu_burners": 2, "thresholds": th,
        "per_config": per_config,
        "ratios": {
            "agreed_local_p50_over_fixed": _ratio(agreed["local_p50_ms"], fixed["local_p50_ms"]),
            "agreed_local_p99_over_fixed": _ratio(agreed["local_p99_ms"], fixed["local_p99_ms"]),
        },
        "aims": {"live_accuracy_within_1_point_of_offline": {
            "target": 0.01,
            "measured": None if agreed["live_accuracy"] is None
            else abs(agreed["live_accuracy"] - agreed["offline_accuracy"]),
            "met": agreed["live_accuracy"] is not None
            and abs(agreed["live_accuracy"] - agreed["offline_accuracy"]) <= 0.01}},
        "note": "devices started 1 s apart while two CPU-bound processes run; latency = capture "
                "to result of local exits",
    }
    write_json(out_dir, "alignment", result)
    _plot(out_dir / "alignment.png", per_config)
    return result


def _ratio(a, b):
    return a / b if a and b else None


def _plot(path: Path, per_config: dict) -> None:
    try:
        plt = pyplot()
    except ImportError:
        return
    names = list(per_config)
    x = np.arange(len(names))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar(x, [per_config[n]["partial_share"] for n in names])
    ax1.set_xticks(x, names)
    ax1.set_ylabel("share of partial answers")
    ax1.set_title("Answers fused from fewer views")
    ax2.bar(x - 0.2, [per_config[n]["local_p50_ms"] or 0 for n in names], 0.4, label="p50")
    ax2.bar(x + 0.2, [per_config[n]["local_p99_ms"] or 0 for n in names], 0.4, label="p99")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("local exit, capture → result (ms)")
    ax2.set_title("What the alignment costs")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
