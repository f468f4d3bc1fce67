"""The loop, closed and measured, live (issue 38, item 4).

A hierarchy (a real Mosquitto, the cloud serving a model repository, an edge with
``--experience``, ``--audit-rate`` and an operator token, three devices watching a camera folder
each) serves a bundle's home domain; the scene drifts (``ddnn data synth --drift``: lighting,
rotation and re-mounted cameras); the drift alarm rises; an operator labels drifted frames over
``POST /v1/feedback`` and a site sends a labelled file; ``ddnn federate`` runs on real Flower
processes; the new signed version goes into the cloud's repository and is announced
(``ddnn announce``), and the edge and every device take it over the air, each past its
probation; the drifted scene is answered again. One timeline: accuracy and the local exit's
share per window of frames, the alarm and the version in force, and the wall time of each
step.

Beside it, the cloud as the only teacher (no human label): a live edge records its experience
(every frame audited, so the cloud answers all of them) and ``ddnn federate --site-experience``
learns from the cloud's soft labels alone, on two drifts: (a) one that misleads the early exits
while the cloud stays sound, (b) the loop's, which fools the cloud too. Each version is scored
offline (``ddnn evaluate``) on a held-out drifted set. Results in ``closed_loop.json``,
``closed_loop.png``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import pyplot, replay_devices, write_json
from ddnn.benchmarks.drift import SCENE
from ddnn.models.synth import DRIFT_KINDS

LOOP_DRIFTS = ("lighting", "rotation", "remount")  # fools every tier (benchmarks/drift.py)
# The drift that leaves the cloud sound while it misleads the early exits: worn, high-gain
# sensors (models/synth.py, SENSOR_NOISE), whose noise an escalated frame's pooled views average
# away (every single drift's exits are measured offline in every run: ``exits_by_drift``).
SOUND_CLOUD_DRIFTS = ("noise",)
SIZES = {  # frames
    "full": {"home": 300, "drifted": 600, "labelled": 300, "site": 1200, "after": 600,
             "teacher": 900, "test": 600},
    "quick": {"home": 100, "drifted": 300, "labelled": 120, "site": 400, "after": 200,
              "teacher": 300, "test": 300},
}
# Half the early exits checked against the cloud, 2 % of disagreement allowed (as
# tests/integration/test_drift.py): at the defaults (0.2, 1 %) the alarm may need more drifted
# frames than the quick run shows.
AUDIT, BUDGET = 0.5, 0.02
TEACHER_FPS = 20.0  # the recording's cameras: paced, so the audits' pulls find their features
PROBATION = 5.0  # seconds each tier watches the new version
OPERATOR = "operator-closed-loop-0123456789"
DEPLOYMENT = "loop"
QUICK_FEDERATE = ("--rounds", "2", "--epochs", "6", "--lr", "0.005", "--batch-size", "32")


# --- the field ----------------------------------------------------------------------------------

def _field(root: Path, n: dict[str, int]) -> dict:
    """The home bundle (trained once, cached, signed) and every frame set of the run."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import (
        SceneConfig,
        apply_drift,
        drifted_config,
        save_dataset,
        synthesize,
    )
    from ddnn.signing import generate_keypair, sign_bundle

    root.mkdir(parents=True, exist_ok=True)
    cfg = SceneConfig(**SCENE)
    bundle = root / "bundle"
    if not (bundle / "manifest.json").exists():
        save_dataset(root / "train.npz", synthesize(800, cfg, seed=1))
        build_bundle(root / "train.npz", bundle,
                     DDNNConfig.from_flat(epochs=8, batch_size=32, seed=0), name="field",
                     version="1", progress=False, log=lambda *_: None)
    keys = root / "keys"
    shutil.rmtree(keys, ignore_errors=True)
    private, public = generate_keypair(keys)
    sign_bundle(bundle, private)

    def drifted(samples: int, seed: int, drifts=LOOP_DRIFTS) -> dict:
        return apply_drift(synthesize(samples, drifted_config(cfg, drifts), seed=seed), drifts)

    files = {"site": drifted(n["site"], 4), "test": drifted(n["test"], 6),
             "teacher-sound": drifted(n["teacher"], 7, SOUND_CLOUD_DRIFTS),
             "test-sound": drifted(n["test"], 8, SOUND_CLOUD_DRIFTS),
             "teacher-fooled": drifted(n["teacher"], 9)}
    for name, data in files.items():
        save_dataset(root / f"{name}.npz", data)
    for drift in DRIFT_KINDS:  # for exits_by_drift
        save_dataset(root / f"only-{drift}.npz", drifted(n["test"], 10, (drift,)))
    return {"bundle": bundle, "private": private, "public": public,
            "stream": {"home": synthesize(n["home"], cfg, seed=2),
                       "drifted": drifted(n["drifted"], 3), "after": drifted(n["after"], 5)}}


class CameraFolders:
    """One folder per camera, filled as a capture tool fills it: a scene's views under one name
    and one modification time, which makes its frame id (``--fps 0``: the time in ms)."""

    def __init__(self, root: Path, views: int):
        self.dirs = [root / f"cam{v}" for v in range(views)]
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
        self.next = 1
        self.labels: dict[int, int] = {}

    def show(self, scenes: dict[str, np.ndarray]) -> range:
        """Write every scene (a dataset's arrays); their frame ids."""
        from PIL import Image

        ids = range(self.next, self.next + len(scenes["label"]))
        for f, X, label in zip(ids, scenes["X"], scenes["label"], strict=True):
            self.labels[f] = int(label)
            for d, image in zip(self.dirs, X, strict=True):
                rgb = np.rint(image.transpose(1, 2, 0) * 255).astype(np.uint8)  # absent: black
                tmp = d / f".{f:09d}.png"  # hidden until renamed: never taken half-written
                Image.fromarray(rgb).save(tmp)
                os.utime(tmp, ((f + 0.5) / 1000, (f + 0.5) / 1000))
                tmp.rename(d / f"{f:09d}.png")
        self.next = ids.stop
        return ids


def _ddnn(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """A ``ddnn`` command as a user runs it; its result and the CPU seconds of its processes."""
    before = os.times()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "ddnn", *args], env=env, capture_output=True,
                         text=True)
    after = os.times()
    if run.returncode != 0:
        raise RuntimeError(f"ddnn {args[0]} failed: {run.stderr[-3000:]}")
    return run, (after.children_user - before.children_user
                 + after.children_system - before.children_system)


def _federate(bundle: Path, sites: list[tuple[str, Path]], out: Path, key: Path,
              quick: bool) -> dict:
    given = [a for flag, p in sites for a in (flag, str(p))]
    start = time.perf_counter()
    run, cpu = _ddnn("federate", "--bundle", str(bundle), *given, "--out", str(out), "--key",
                     str(key), "--json", *(QUICK_FEDERATE if quick else ()))
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return {**{k: result[k] for k in ("version", "rounds", "communicated_bytes")},
            "seconds": round(time.perf_counter() - start, 1), "cpu_seconds": round(cpu, 1)}


def _evaluate(bundle: Path, data: Path, local_threshold: float | None = None) -> dict:
    """``ddnn evaluate``'s accuracy (the hierarchy as calibrated, or with ``local_threshold``)
    and local-exit share."""
    from ddnn.tools.evaluate import evaluate

    r = evaluate(bundle, data, local_threshold=local_threshold)
    return {"accuracy": {k: round(v, 3) for k, v in r["accuracy"].items()},
            "local_share": round(r["exit_fraction"]["local"], 3)}


def _own_exits(bundle: Path, data: Path) -> dict[str, float]:
    """Each exit's own accuracy on every frame, unstacked: what a teacher changed where no
    frame reaches it yet."""
    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.runtime import BundleRuntime

    b = load_bundle(bundle)
    ds = load_dataset(data, num_classes=b.manifest.num_classes)
    own = BundleRuntime(b).run_dataset(ds.X, ds.present, stacked=False)
    return {k: round(float((own[k].argmax(-1) == ds.label).mean()), 3)
            for k in ("local", "edge", "cloud", "escalated") if k in own}


# --- the loop, live -----------------------------------------------------------------------------

class Timeline:
    """The edge sampled every 0.2 s (answered, alarm, version, thresholds), and the steps."""

    def __init__(self, agg):
        self.agg, self.t0 = agg, time.monotonic()
        self.samples: list[dict] = []
        self.steps: list[dict] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline")
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            snap = self.agg.snapshot()
            drift = snap.drift or {}
            self.samples.append({"t": self.now(), "answered": snap.answered,
                                 "alarm": bool(drift.get("alarm")),
                                 "version": snap.manifest.version})

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def step(self, what: str, **facts) -> None:
        self.steps.append({"t": self.now(), "answered": self.agg.answered, "step": what, **facts})

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (got := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got


def _label(url: str, frame: int, label: str) -> bool:
    """One operator label (again after a 429: the route allows 10 a second per address);
    False: the frame's features are gone (410: no device answered the pull in time), as an
    operator would see it and label the next one."""
    import httpx

    while True:
        r = httpx.post(url, json={"frame": frame, "label": label},
                       headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30)
        if r.status_code != 429:
            break
        time.sleep(float(r.headers.get("Retry-After", "0.1")))
    if r.status_code not in (201, 410):
        raise RuntimeError(f"feedback for frame {frame}: {r.status_code} {r.text}")
    return r.status_code == 201


def _loop(root: Path, field: dict, n: dict[str, int], broker: str, quick: bool) -> dict:
    """The whole loop once; its timeline, results and steps."""
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from ddnn.device.service import DeviceService
    from ddnn.device.settings import DeviceSettings
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    work = root / "loop"
    shutil.rmtree(work, ignore_errors=True)
    bundle, public = field["bundle"], field["public"]
    repository = work / "repository"
    shutil.copytree(bundle, repository / "field-1")
    for tier in ("edge", "cam0", "cam1", "cam2"):
        shutil.copytree(bundle, work / tier / "field")  # each tier's own copy, as on its disk
    experience, results_out = work / "experience", work / "results.jsonl"
    cloud_settings = CloudSettings(repository=repository, host="127.0.0.1", port=0,
                                   poll_interval=0.5, bundle_key=public, max_queue_delay_ms=5.0)
    with contextlib.ExitStack() as stack:
        cloud = stack.enter_context(run_server(cloud_settings)).url
        edge = stack.enter_context(EdgeService.from_settings(EdgeSettings(
            bundle=work / "edge" / "field", broker=broker, cloud=cloud, deployment=DEPLOYMENT,
            http_port=0, results_out=results_out, audit_rate=AUDIT, agreement_budget=BUDGET,
            experience=experience,
            operator_token=OPERATOR, bundle_key=public, ota_probation=PROBATION)))
        agg = edge.aggregator
        edge.mqtt.wait_subscribed(10)
        views = agg.manifest.views
        cameras = CameraFolders(work / "cameras", views)
        devices = [stack.enter_context(DeviceService.from_settings(DeviceSettings(
            bundle=work / f"cam{v}" / "field", view=v, broker=broker, deployment=DEPLOYMENT,
            images=cameras.dirs[v], follow=True, fps=0, bundle_key=public,
            ota_probation=PROBATION, peers=tuple(f"cam{i}" for i in range(views)),
            wait_peers=20))) for v in range(views)]
        threads = [threading.Thread(target=d.run) for d in devices]
        for t in threads:
            t.start()
        for d, t in zip(devices, threads, strict=True):
            stack.callback(t.join, 60)
            stack.callback(d.stop_event.set)  # (a followed folder stops waiting too)
        timeline = Timeline(agg)
        stack.callback(timeline.stop)

        phases = {}
        for name in ("home", "drifted"):
            phases[name] = cameras.show(field["stream"][name])
            timeline.step(f"{name} frames shown")
            _wait(lambda: agg.answered == cameras.next - 1, 300, f"the {name} frames")
        timeline.step("drifted frames answered", alarm=bool(agg.snapshot().drift["alarm"]))

        url = f"{edge.http.url}/v1/feedback"
        classes = agg.manifest.classes
        labelled = phases["drifted"][-n["labelled"]:]
        recorded = sum(_label(url, f, classes[cameras.labels[f]]) for f in labelled)
        timeline.step("operator labels recorded", frames=recorded, gone=len(labelled) - recorded)
        # The labels are written at once; the cloud's answers in chunks (256 frames, or every
        # 30 s): the federation learns from those written by then, as an operator's would.
        _wait(lambda: _labelled_on_disk(experience) == recorded, 60, "the labels written")
        timeline.step("experience on disk", frames=_recorded(experience), labelled=recorded)

        out = work / "federated"
        federation = _federate(bundle, [("--site", experience), ("--site", root / "site.npz")],
                               out, field["private"], quick)
        version = federation["version"]
        timeline.step("federated", **federation)
        shutil.copytree(out, repository / f"field-{version}")
        _ddnn("announce", "--broker", broker, "--deployment", DEPLOYMENT, "--name", "field",
              "--version", version, "--cloud", cloud)
        timeline.step("announced", version=version)
        updaters = {"edge": edge.updater, **{f"cam{v}": d.updater for v, d in enumerate(devices)}}
        _wait(lambda: all(u.running.manifest.version == version for u in updaters.values()), 300,
              "every tier running the new version")
        timeline.step("applied on every tier")
        _wait(lambda: all(u.status()["probation"] is None for u in updaters.values()), 300,
              "every probation over")
        rolled_back = {k: u.status().get("rolled_back_from") for k, u in updaters.items()}
        timeline.step("probation passed on every tier", rolled_back=rolled_back)

        phases["after"] = cameras.show(field["stream"]["after"])
        timeline.step("after frames shown")
        _wait(lambda: agg.answered == cameras.next - 1, 300, "the frames after the update")
        timeline.step("after frames answered")
        versions = {"cloud": _cloud_versions(cloud), **{k: u.running.manifest.version
                                                        for k, u in updaters.items()}}
    results = _results(results_out)
    return {"results": results, "labels": cameras.labels, "phases": phases,
            "samples": timeline.samples, "steps": timeline.steps, "version": version,
            "versions": versions, "rolled_back": rolled_back, "federation": federation,
            "federated_bundle": out}


def _results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _cloud_versions(cloud: str) -> dict[str, float]:
    """Inference requests the cloud answered (200), by version (its Prometheus text)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{cloud}/metrics", timeout=5).text.splitlines():
        if line.startswith("ddnn_cloud_requests_total{") and 'code="200"' in line:
            version = line.split('version="', 1)[1].split('"', 1)[0]
            out[version] = out.get(version, 0) + float(line.rsplit(" ", 1)[1])
    return out


def _windows(results: list[dict], labels: dict[int, int], window: int) -> list[dict]:
    by_frame = sorted(results, key=lambda r: r["frame"])
    rows = []
    for i in range(0, len(by_frame), window):
        got = by_frame[i:i + window]
        rows.append({"first_frame": got[0]["frame"], "frames": len(got),
                     "accuracy": round(float(np.mean([r["class"] == labels[r["frame"]]
                                                      for r in got])), 3),
                     "local_share": round(float(np.mean([r["exit"] == "local" for r in got])),
                                          3)})
    return rows


def _phase(results: list[dict], labels: dict[int, int], frames: range) -> dict:
    got = [r for r in results if r["frame"] in frames]
    return {"frames": len(got),
            "accuracy": round(float(np.mean([r["class"] == labels[r["frame"]] for r in got])), 3),
            "local_share": round(float(np.mean([r["exit"] == "local" for r in got])), 3)}


# --- the cloud as the only teacher --------------------------------------------------------------

def _teacher(root: Path, field: dict, broker: str, case: str, quick: bool) -> dict:
    """A live edge records its experience of ``teacher-{case}.npz`` (every early exit audited:
    the cloud answers every frame); ``ddnn federate --site-experience`` learns from it alone."""
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings
    from ddnn.edge.service import EdgeService
    from ddnn.edge.settings import EdgeSettings

    work = root / f"teacher-{case}"
    shutil.rmtree(work, ignore_errors=True)
    bundle, replay = field["bundle"], root / f"teacher-{case}.npz"
    experience = work / "experience"
    with run_server(CloudSettings(bundle=bundle, host="127.0.0.1", port=0,
                                  max_queue_delay_ms=5.0)) as cloud:
        s = EdgeSettings(bundle=bundle, broker=broker, cloud=cloud.url, deployment=f"t-{case}",
                         audit_rate=1.0, experience=experience)
        with EdgeService.from_settings(s) as edge:
            edge.mqtt.wait_subscribed(10)
            replay_devices(bundle, replay, broker, edge.aggregator.manifest.views,
                           deployment=f"t-{case}", fps=TEACHER_FPS)
            frames = len(np.load(replay)["label"])
            _wait(lambda: edge.aggregator.answered == frames, 120, "every frame answered")
        # (leaving the edge writes what is left of the experience)
    out = work / "federated"
    federation = _federate(bundle, [("--site-experience", experience)], out, field["private"],
                           quick)
    test = root / ("test-sound.npz" if case == "sound" else "test.npz")
    return {"drifts": list(SOUND_CLOUD_DRIFTS if case == "sound" else LOOP_DRIFTS),
            "recorded_frames": _recorded(experience), "federation": federation,
            "before": _evaluate(bundle, test), "after": _evaluate(out, test),
            "exits_before": _own_exits(bundle, test), "exits_after": _own_exits(out, test),
            # The local exit shut, as the adapted thresholds shut it once the alarm rises: the
            # frames go up to the exits the cloud's answers taught.
            "before_local_shut": _evaluate(bundle, test, local_threshold=0.0),
            "after_local_shut": _evaluate(out, test, local_threshold=0.0)}


def _labelled_on_disk(directory: Path) -> int:
    from ddnn.experience import chunks, read_experience

    return int(read_experience(directory).labelled.sum()) if chunks(directory) else 0


def _recorded(directory: Path) -> int:
    from ddnn.experience import read_experience

    return int(read_experience(directory).num_samples)


# --- the plot and the run -----------------------------------------------------------------------

def _plot(out_dir: Path, loop: dict, windows: list[dict]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    x = [w["first_frame"] + w["frames"] / 2 for w in windows]
    axes[0].plot(x, [w["accuracy"] for w in windows], marker="o", label="accuracy")
    axes[0].plot(x, [w["local_share"] for w in windows], marker="s", label="local exits")
    axes[0].set_ylim(0, 1.05)
    axes[0].set_title("answers per window of frames", fontsize=10)
    # The alarm and the version against the frames answered when they were sampled.
    frames = [s["answered"] for s in loop["samples"]]
    axes[1].step(frames, [int(s["alarm"]) for s in loop["samples"]], where="post",
                 color="tab:red")
    axes[1].set_yticks([0, 1], ["off", "up"])
    axes[1].set_title("drift alarm", fontsize=10)
    versions = sorted({s["version"] for s in loop["samples"]}, key=_version_key)
    axes[2].step(frames, [versions.index(s["version"]) for s in loop["samples"]], where="post",
                 color="tab:green")
    axes[2].set_yticks(range(len(versions)), versions)
    axes[2].set_title("version the edge runs", fontsize=10)
    axes[2].set_xlabel("frame")
    first = {name: r.start for name, r in loop["phases"].items()}
    for ax in axes:
        ax.axvline(first["drifted"], color="grey", linestyle=":")
        ax.axvline(first["after"], color="black", linestyle="--")
    steps = {s["step"]: s["t"] for s in loop["steps"]}
    pause = steps["probation passed on every tier"] - steps["drifted frames answered"]
    axes[0].annotate("drift", (first["drifted"], 0.05), fontsize=8)
    axes[0].annotate(f"updated ({pause:.0f} s: labels, federation, over the air)",
                     (first["after"], 0.05), fontsize=8, ha="right")
    axes[0].legend(fontsize=8, loc="center left")
    fig.tight_layout()
    fig.savefig(out_dir / "closed_loop.png", dpi=120)
    plt.close(fig)


def _version_key(v: str) -> tuple:
    from ddnn.versions import version_key

    return version_key(v)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    from ddnn.tools.broker import start_broker

    n = SIZES["quick" if quick else "full"]
    root = work / "closed_loop"
    field = _field(root, n)
    broker = start_broker(prefer="mosquitto")
    try:
        loop = _loop(root, field, n, broker.url, quick)
        teacher = {case: _teacher(root, field, broker.url, case, quick)
                   for case in ("sound", "fooled")}
    finally:
        broker.stop()
    window = 50 if quick else 100
    windows = _windows(loop["results"], loop["labels"], window)
    phases = {k: _phase(loop["results"], loop["labels"], r) for k, r in loop["phases"].items()}
    exits_by_drift = {d: _evaluate(field["bundle"], root / f"only-{d}.npz")["accuracy"]
                      for d in DRIFT_KINDS}
    offline = {"before": _evaluate(field["bundle"], root / "test.npz"),
               "after": _evaluate(loop["federated_bundle"], root / "test.npz")}
    steps = {s["step"]: s for s in loop["steps"]}
    alarm_at = next((s["answered"] for s in loop["samples"] if s["alarm"]), None)
    result = {
        "sizes": n, "audit_rate": AUDIT, "agreement_budget": BUDGET, "probation_s": PROBATION,
        "window": window, "teacher_fps": TEACHER_FPS,
        "drifts": list(LOOP_DRIFTS), "federate_args": list(QUICK_FEDERATE) if quick else [],
        "phases": phases, "offline_test": offline,
        "alarm_after_drifted_frames": (None if alarm_at is None
                                       else alarm_at - len(loop["phases"]["home"])),
        "recovery_points": round(100 * (phases["after"]["accuracy"]
                                        - phases["drifted"]["accuracy"]), 1),
        "version": loop["version"], "versions_after": loop["versions"],
        "rolled_back": loop["rolled_back"], "federation": loop["federation"],
        "seconds": {"labels_to_updated": round(
            steps["probation passed on every tier"]["t"] - steps["drifted frames answered"]["t"],
            1), "federation": loop["federation"]["seconds"]},
        "steps": loop["steps"], "windows": windows, "teacher": teacher,
        "exits_by_drift": exits_by_drift,
        "samples": loop["samples"][::5]}
    write_json(out_dir, "closed_loop", result)
    _plot(out_dir, loop, windows)
    return result
