"""What the benchmarks share: the default generated dataset and bundle, cached, and JSON output."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The default generated set of the docs: MVMC's shape (6 cameras, 3 classes, 32×32).
TRAIN_SAMPLES, TEST_SAMPLES = 1500, 1000  # 1500: the training-time aim (4 min)
QUICK_TRAIN, QUICK_TEST = 600, 200


@dataclass(frozen=True)
class Workspace:
    """Datasets and the bundle a benchmark run uses, under ``root`` (reused when present)."""

    root: Path
    train: Path
    test: Path
    bundle: Path
    train_seconds: float | None  # None when the bundle was reused from an earlier run


def ddnn(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run the ``ddnn`` CLI in a child process, as a user would."""
    out = subprocess.DEVNULL if quiet else None
    return subprocess.run([sys.executable, "-m", "ddnn", *args], check=check, stdout=out)


def workspace(root: Path, quick: bool = False, epochs: int | None = None) -> Workspace:
    """Generate the default dataset and train the default bundle unless already there."""
    root.mkdir(parents=True, exist_ok=True)
    n_train, n_test = (QUICK_TRAIN, QUICK_TEST) if quick else (TRAIN_SAMPLES, TEST_SAMPLES)
    train, test, bundle = root / "train.npz", root / "test.npz", root / "bundle"
    if not train.exists():
        ddnn("data", "synth", "--out", str(train), "--samples", str(n_train), "--seed", "1")
    if not test.exists():
        ddnn("data", "synth", "--out", str(test), "--samples", str(n_test), "--seed", "2")
    seconds = None
    if not (bundle / "manifest.json").exists():
        start = time.perf_counter()
        args = ["train", "--data", str(train), "--out", str(bundle), "--name", "mvmc"]
        if epochs or quick:
            args += ["--epochs", str(epochs or 5)]
        ddnn(*args)
        seconds = time.perf_counter() - start
    return Workspace(root, train, test, bundle, seconds)


def reference_bundle(ws: Workspace, quick: bool = False) -> Path:
    """The raw-offload reference (``ddnn train --baseline``) of the workspace's bundle: the same
    training file, name and epochs; trained once, unless already there."""
    out = ws.root / "raw_reference"  # one reference for `training` and `raw_vs_hierarchy`
    if not (out / "manifest.json").exists():
        args = ["train", "--baseline", "--data", str(ws.train), "--test", str(ws.test),
                "--out", str(out), "--name", "mvmc", "--no-progress"]
        ddnn(*args, *(["--epochs", "5"] if quick else []))
    return out


def stop_process(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    """SIGTERM a child, then SIGKILL it if it has not exited within ``timeout`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def replay_devices(bundle: Path, replay: Path, broker: str, views: int, *, deployment: str,
                   fps: float) -> None:
    """One device agent per view, in threads of this process, replaying ``replay`` at ``fps``
    in pull mode; returns once every one has sent its last frame."""
    from ddnn.device.service import DeviceService
    from ddnn.device.settings import DeviceSettings

    with contextlib.ExitStack() as stack:
        services = [stack.enter_context(DeviceService.from_settings(DeviceSettings(
            bundle=bundle, view=v, broker=broker, deployment=deployment, mode="pull",
            data=replay, fps=fps, grace=0.5, drain_timeout=30,
            peers=tuple(f"cam{i}" for i in range(views)), wait_peers=20)))
            for v in range(views)]
        threads = [threading.Thread(target=s.run) for s in services]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def write_json(out_dir: Path, name: str, result: dict) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def pyplot():
    """matplotlib's pyplot drawing to files only (no display on servers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def machine() -> dict:
    """Where the numbers were taken: they only compare within one run on one machine."""
    import os
    import platform

    return {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(terse=True),
    }


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile of ``xs``, None for no samples."""
    return float(np.percentile(xs, q)) if xs else None
