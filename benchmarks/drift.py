"""Live replay across a domain change: exits with fixed thresholds beside exits that adapt them
(``ddnn edge --audit-rate --adapt-thresholds``), issue 26.6's live half.

A bundle trained on one domain; three devices replay that domain and then a drifted one
(``ddnn data synth --drift all``) at a camera's pace through a real Mosquitto, an edge and a
cloud (in this process, each on its own threads). Two runs over the same replay and the same
edge settings but ``--adapt-thresholds``: both audit the same share of early exits, so the
drift alarm is measured in both; only the adaptive one moves its thresholds. Per window of
frames: the accuracy of the answers (against the replay's labels), the local exit's share, the
frames that reached the cloud (forwarded and audited); over time: the thresholds in force and
the alarm; offline, each exit's accuracy on the drifted frames (``ddnn evaluate``), which says
what answering more frames at the cloud can win back. Results in ``drift.json``, ``drift.png``.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import pyplot, replay_devices, write_json

SCENE = {"views": 3, "classes": 3, "size": 16, "body_blobs": 3, "parts": 3,
         "absent_prob": 0.05, "occlusion_prob": 0.1, "noise": 0.03}  # as tests/support/data.py
DRIFTS = ("lighting", "rotation", "remount")
BEFORE, AFTER = 300, 900  # frames of the bundle's domain, then of the drifted one
FPS = 20.0  # the cameras' pace
AUDIT = 0.2  # share of early exits checked against the cloud, in both runs
WINDOW = 100  # frames per point of the curves


def _field(root: Path, quick: bool) -> tuple[Path, Path, np.ndarray]:
    """The bundle (trained once, cached) and the replay; the replay's labels."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import (
        SceneConfig,
        apply_drift,
        drifted_config,
        save_dataset,
        synthesize,
    )

    root.mkdir(parents=True, exist_ok=True)
    cfg = SceneConfig(**SCENE)
    bundle, replay = root / "bundle", root / "replay.npz"
    if not (bundle / "manifest.json").exists():
        save_dataset(root / "train.npz", synthesize(800, cfg, seed=1))
        build_bundle(root / "train.npz", bundle,
                     DDNNConfig.from_flat(epochs=8, batch_size=32, seed=0), name="field",
                     version="1", progress=False, log=lambda *_: None)
    before, after = (BEFORE // 2, AFTER // 2) if quick else (BEFORE, AFTER)
    parts = [synthesize(before, cfg, seed=2),
             apply_drift(synthesize(after, drifted_config(cfg, DRIFTS), seed=3), DRIFTS)]
    data = {k: (np.concatenate([p[k] for p in parts]) if k != "classes" else parts[0][k])
            for k in parts[0]}
    save_dataset(replay, data)
    save_dataset(root / "drifted.npz", parts[1])  # for the exits' offline accuracy on it
    return bundle, replay, data["label"]


def _replay(bundle: Path, replay: Path, broker: str, cloud: str, adapt: bool,
            work: Path) -> tuple[list[dict], list[dict], dict]:
    """One run: the results, the edge's drift status sampled over time, its counts."""
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    out = work / f"results-{'adaptive' if adapt else 'fixed'}.jsonl"
    out.unlink(missing_ok=True)
    s = EdgeSettings(bundle=bundle, broker=broker, cloud=cloud, deployment="drift",
                     results_out=out, audit_rate=AUDIT, adapt_thresholds=adapt)
    samples: list[dict] = []
    with EdgeService.from_settings(s) as service:
        agg = service.aggregator
        service.mqtt.wait_subscribed(10)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.2):
                st = agg.snapshot().drift or {}
                samples.append({"answered": agg.answered, "alarm": st.get("alarm"),
                                "local": st.get("thresholds", {}).get("local"),
                                "agreement_configured": st.get("agreement_configured")})

        sampler = threading.Thread(target=sample)
        sampler.start()
        replay_devices(bundle, replay, broker, agg.manifest.views, deployment="drift", fps=FPS)
        time.sleep(1.0)  # the last cloud answers of audits (no result waits on them)
        done.set()
        sampler.join()
        series = agg.metrics.learning
        counts = {"audits": sum(series.audits.value(exit=e) for e in ("local", "edge")),
                  "cloud_calls_ok": agg.metrics.cloud.value(outcome="ok"),
                  "tightened": series.threshold_changes.value(direction="tighten"),
                  "relaxed": series.threshold_changes.value(direction="relax")}
    results = [json.loads(line) for line in out.read_text().splitlines()]
    return results, samples, counts


def _curves(results: list[dict], labels: np.ndarray) -> dict:
    by_frame = {r["frame"]: r for r in results}
    rows = []
    for start in range(0, len(labels), WINDOW):
        got = [by_frame[i] for i in range(start, min(start + WINDOW, len(labels)))
               if i in by_frame]
        if not got:
            continue
        rows.append({
            "first_frame": start, "frames": len(got),
            "accuracy": round(float(np.mean([r["class"] == labels[r["frame"]] for r in got])), 3),
            "local_share": round(float(np.mean([r["exit"] == "local" for r in got])), 3),
            "cloud_share": round(float(np.mean([r["exit"] == "cloud" for r in got])), 3)})
    return {"windows": rows, "answered": len(by_frame)}


def _alarm_frame(samples: list[dict], before: int) -> int | None:
    """Frames of the drifted domain answered when the alarm was first seen up."""
    for s in samples:
        if s["alarm"]:
            return max(s["answered"] - before, 0)
    return None


def _plot(out_dir: Path, runs: dict, before: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, r in runs.items():
        w = r["curves"]["windows"]
        x = [row["first_frame"] + row["frames"] / 2 for row in w]
        axes[0].plot(x, [row["accuracy"] for row in w], marker="o", label=name)
        axes[1].plot(x, [row["local_share"] for row in w], marker="o", label=name)
        axes[2].step([s["answered"] for s in r["samples"]],
                     [s["local"] for s in r["samples"]], where="post", label=name)
    for ax, title in zip(axes, ("accuracy of the answers", "local exit's share",
                                "local threshold in force"), strict=True):
        ax.axvline(before, color="grey", linestyle=":", label="domain change")
        ax.set_xlabel("frame")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "drift.png", dpi=120)
    plt.close(fig)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from ddnn.tools.broker import start_broker

    root = work / "drift"
    bundle, replay, labels = _field(root, quick)
    before = BEFORE // 2 if quick else BEFORE
    runs = {}
    broker = start_broker(prefer="mosquitto")
    try:
        with run_server(CloudSettings(bundle=bundle, host="127.0.0.1", port=0,
                                      max_queue_delay_ms=5.0)) as cloud:
            for name, adapt in (("fixed", False), ("adaptive", True)):
                results, samples, counts = _replay(bundle, replay, broker.url, cloud.url,
                                                   adapt, root)
                curves = _curves(results, labels)
                drifted = [r for r in results if r["frame"] >= before]
                runs[name] = {
                    "curves": curves, "samples": samples, "counts": counts,
                    "alarm_after_drifted_frames": _alarm_frame(samples, before),
                    "accuracy_drifted": round(float(np.mean(
                        [r["class"] == labels[r["frame"]] for r in drifted])), 3),
                    "local_share_drifted": round(float(np.mean(
                        [r["exit"] == "local" for r in drifted])), 3),
                    "cloud_frames_per_frame": round(
                        (counts["audits"] + sum(r["exit"] == "cloud" for r in results))
                        / max(len(results), 1), 3)}
    finally:
        broker.stop()
    from ddnn.tools.evaluate import evaluate

    offline = evaluate(bundle, root / "drifted.npz")["accuracy"]  # every exit, every frame
    summary = {k: {m: v[m] for m in ("alarm_after_drifted_frames", "accuracy_drifted",
                                     "local_share_drifted", "cloud_frames_per_frame")}
               for k, v in runs.items()}
    result = {"frames": {"before": before, "after": len(labels) - before}, "fps": FPS,
              "audit_rate": AUDIT, "window": WINDOW, "drifts": list(DRIFTS),
              "drifted_accuracy_offline": {k: round(v, 3) for k, v in offline.items()},
              "summary": summary, "runs": runs}
    write_json(out_dir, "drift", result)
    _plot(out_dir, runs, before)
    return result
