"""Live replay whose cloud slows down mid-run: fixed exit thresholds beside the latency planner
(``ddnn edge --latency-slo``), issue 42.

A small bundle (its calibration stores the operating curve); three devices replay at a camera's
pace through a real Mosquitto, an edge and a cloud (in this process, each on its own threads).
The edge reaches the cloud through a TCP relay that holds the cloud's traffic: nothing in the
first phase, :data:`DELAY` in the second (a congested or far cloud), nothing in the third. A
rate limit alone (tbf, 10 Mbit/s -> 256 kbit/s, as ``bandwidth`` shapes the devices' uplink)
does not make this cloud slow: its calls carry a few hundred bytes, a few milliseconds at
256 kbit/s; added delay does. Two runs over the same replay and settings but the objective,
both from the curve's most accurate point (what an edge without an objective would run):
``fixed`` keeps it, ``planner`` runs ``--latency-slo`` :data:`SLO_MS`. Per phase (by capture
time): the p99 of capture-to-answer latency against the objective, the accuracy of the answers
(against the replay's labels) and the exit shares; over time, each answer's latency and the
planner's point. The first :data:`WARMUP` seconds of each run are not counted. Results in
``latency_slo.json``, ``latency_slo.png``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import pyplot, replay_devices, write_json
from ddnn.edge.events import EdgeEvents
from ddnn.result import Result
from ddnn.tools.relay import DelayingRelay

# The drift benchmark's scene, noisier and more occluded: a local exit that is often unsure, so
# that the curve has points sending frames up that are more accurate than it.
SCENE = {"views": 3, "classes": 3, "size": 16, "body_blobs": 3, "parts": 3,
         "absent_prob": 0.1, "occlusion_prob": 0.4, "noise": 0.25}
PHASES = ("fast", "slow", "recovered")
FRAMES = 300  # frames per phase (half with --quick)
FPS = 20.0  # the cameras' pace
WARMUP = 2.0  # seconds of frames before the first phase, not counted: the first calls open
# connections and run cold ONNX sessions (a frame then may take a second)
DELAY = 0.3  # seconds the relay holds the cloud's traffic in the slow phase
SLO_MS, PERCENTILE = 100.0, 99.0
WAIT_MS = 30.0  # the views' wait, both runs: well under the objective
SETTLE = 3.0  # seconds into a phase after which the objective is to hold (the planner's
# re-planning: a window of costs that moved, a plan every 0.5 s)


class Answers(EdgeEvents):
    """Each answer: frame, exit, class, capture time (wall clock) and latency (seconds); and
    the planner's point over time (its thresholds and held-out accuracy)."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, int | None, float, float]] = []
        self.plans: list[tuple[float, float, float, float]] = []
        self._lock = threading.Lock()

    def on_answered(self, result: Result, step: str, latency: float) -> None:
        with self._lock:
            self.rows.append((result.frame, result.exit, result.cls, time.time() - latency,
                              latency))

    def on_latency_plan(self, point, objective, predicted, measured, met) -> None:
        with self._lock:
            self.plans.append((time.time(), point["local"], point["edge"], point["accuracy"]))


def _field(root: Path, quick: bool) -> tuple[Path, Path, np.ndarray]:
    """The bundle (trained once, cached) and the replay; the replay's labels."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    root.mkdir(parents=True, exist_ok=True)
    cfg = SceneConfig(**SCENE)
    bundle, replay = root / "bundle", root / "replay.npz"
    if not (bundle / "manifest.json").exists():
        save_dataset(root / "train.npz", synthesize(800, cfg, seed=1))
        build_bundle(root / "train.npz", bundle,
                     DDNNConfig.from_flat(epochs=4 if quick else 8, batch_size=32, seed=0),
                     name="slo", version="1", progress=False, log=lambda *_: None)
    frames = len(PHASES) * (FRAMES // 2 if quick else FRAMES) + int(WARMUP * FPS)
    data = synthesize(frames, cfg, seed=2)
    save_dataset(replay, data)
    return bundle, replay, data["label"]


def most_accurate(bundle: Path, *, cloud: bool = True) -> dict[str, float]:
    """The thresholds of the bundle's most accurate curve point (ties: fewer bytes); with
    ``cloud`` False, of those that send no frame up."""
    from ddnn.bundle import load_bundle
    from ddnn.edge.planner import curve_points

    best = max((p for p in curve_points(load_bundle(bundle).manifest)
                if cloud or p.exit_fraction["cloud"] <= 0),
               key=lambda p: (p.accuracy, -p.bytes_per_frame))
    return {"local_threshold": best.local, "edge_threshold": best.edge}


def fixed_points(bundle: Path) -> dict[str, dict[str, float]]:
    """The fixed runs: the most accurate point (what an edge without an objective runs) and
    the most accurate that sends nothing up (one that holds the objective whatever the cloud)."""
    return {"fixed": most_accurate(bundle), "fixed-no-cloud": most_accurate(bundle, cloud=False)}


def _replay(bundle: Path, replay: Path, broker: str, relay: DelayingRelay, frames: int,
            thresholds: dict[str, float], planner: bool
            ) -> tuple[Answers, list[float], dict | None]:
    """One run from ``thresholds``: its answers, the wall times the phases began, the
    planner's last status."""
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    relay.delay = 0.0
    seen = Answers()
    s = EdgeSettings(bundle=bundle, broker=broker, cloud=relay.http_url, deployment="slo",
                     deadline_ms=WAIT_MS, max_wait_ms=WAIT_MS, **thresholds,
                     latency_slo=SLO_MS if planner else None, latency_percentile=PERCENTILE)
    starts: list[float] = []
    with EdgeService.from_settings(s, observers=[seen]) as service:
        agg = service.aggregator
        service.mqtt.wait_subscribed(10)
        done = threading.Event()

        def phases() -> None:  # the phases by the cameras' clock, after the warm-up
            while not seen.rows and not done.wait(0.01):
                pass
            if done.wait(WARMUP):
                return
            for delay in (0.0, DELAY, 0.0):
                starts.append(time.time())
                relay.delay = delay
                if done.wait(frames / FPS):
                    return

        switcher = threading.Thread(target=phases)
        switcher.start()
        replay_devices(bundle, replay, broker, agg.manifest.views, deployment="slo", fps=FPS)
        time.sleep(1.0)
        done.set()
        switcher.join()
        status = agg.snapshot().latency
    return seen, starts, status


def _phase_stats(seen: Answers, starts: list[float], labels: np.ndarray) -> dict:
    rows = sorted(seen.rows, key=lambda r: r[3])
    edges = [*starts[1:], np.inf]
    out = {}
    for name, start, end in zip(PHASES, starts, edges, strict=True):  # (the warm-up left out)
        got = [r for r in rows if start <= r[3] < end]
        if not got:
            out[name] = {"frames": 0}
            continue
        lat = np.array([r[4] for r in got])
        settled = np.array([r[4] for r in got if r[3] >= start + SETTLE])
        out[name] = {
            "frames": len(got),
            "p50_ms": round(1000 * float(np.percentile(lat, 50)), 1),
            "p99_ms": round(1000 * float(np.percentile(lat, PERCENTILE)), 1),
            "p99_settled_ms": round(1000 * float(np.percentile(settled, PERCENTILE)), 1)
            if settled.size else None,
            "within_objective": round(float(np.mean(lat <= SLO_MS / 1000)), 3),
            "accuracy": round(float(np.mean([labels[r[0]] == r[2] for r in got])), 3),
            **{f"{e}_share": round(float(np.mean([r[1] == e for r in got])), 3)
               for e in ("local", "edge", "cloud")}}
    return out


def against_fixed(summary: dict) -> dict:
    """Per phase: the most accurate fixed run that held the objective (the p99 of the frames
    after :data:`SETTLE` seconds within it) and the planner's accuracy beside it (points; None
    where no fixed run held it or the planner missed it)."""
    def holds(phase: dict) -> bool:
        return (phase.get("p99_settled_ms") or np.inf) <= SLO_MS

    out = {}
    for phase in PHASES:
        holding = {k: v[phase] for k, v in summary.items()
                   if k != "planner" and holds(v[phase])}
        best = max(holding, key=lambda k: holding[k]["accuracy"], default=None)
        planner = summary["planner"][phase]
        held = holds(planner)
        out[phase] = {"best_fixed": best, "planner_held": held,
                      "gap_points": round(100 * (planner["accuracy"] -
                                                 holding[best]["accuracy"]), 1)
                      if best is not None and held else None}
    return out


def _plot(out_dir: Path, runs: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    for name, r in runs.items():
        t0 = r["phase_starts"][0]
        t = [row[0] - t0 for row in r["answers"]]  # (the warm-up before 0)
        axes[0].scatter(t, [1000 * row[1] for row in r["answers"]], s=4, label=name, alpha=0.6)
        if r["plans"]:
            axes[1].step([p[0] - t0 for p in r["plans"]], [p[3] for p in r["plans"]],
                         where="post", label=f"{name}: the point in force")
    axes[0].axhline(SLO_MS, color="red", linestyle="--", label=f"objective (p{PERCENTILE:g})")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("capture to answer (ms)")
    axes[1].set_ylabel("held-out accuracy of the point")
    axes[1].set_xlabel("seconds (capture time)")
    for ax in axes:
        starts = next(iter(runs.values()))["phase_starts"]
        for s, name in zip(starts, PHASES, strict=True):
            ax.axvline(s - starts[0], color="grey", linestyle=":")
            ax.text(s - starts[0], ax.get_ylim()[1], name, fontsize=7, va="top")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "latency_slo.png", dpi=120)
    plt.close(fig)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from ddnn.tools.broker import start_broker

    root = work / "latency_slo"
    bundle, replay, labels = _field(root, quick)
    frames = FRAMES // 2 if quick else FRAMES
    runs: dict = {}
    broker = start_broker(prefer="mosquitto")
    try:
        with run_server(CloudSettings(bundle=bundle, host="127.0.0.1", port=0,
                                      max_queue_delay_ms=2.0)) as cloud:
            host, port = cloud.url.removeprefix("http://").rsplit(":", 1)
            relay = DelayingRelay((host, int(port)))
            try:
                starting = {**fixed_points(bundle), "planner": most_accurate(bundle)}
                for name, thresholds in starting.items():
                    seen, starts, status = _replay(bundle, replay, broker.url, relay, frames,
                                                   thresholds, planner=name == "planner")
                    runs[name] = {
                        "phases": _phase_stats(seen, starts, labels), "status": status,
                        "phase_starts": starts,
                        "answers": [(round(r[3], 3), round(r[4], 4))
                                    for r in sorted(seen.rows, key=lambda r: r[3])],
                        "plans": [(round(t, 3), local, edge, round(accuracy, 4))
                                  for t, local, edge, accuracy in seen.plans]}
            finally:
                relay.stop()
    finally:
        broker.stop()
    summary = {k: v["phases"] for k, v in runs.items()}
    result = {"frames_per_phase": frames, "thresholds": starting, "fps": FPS,
              "delay_s": DELAY, "warmup_s": WARMUP,
              "objective_ms": SLO_MS, "percentile": PERCENTILE, "wait_ms": WAIT_MS,
              "summary": summary, "against_fixed": against_fixed(summary), "runs": runs}
    write_json(out_dir, "latency_slo", result)
    _plot(out_dir, runs)
    return result
