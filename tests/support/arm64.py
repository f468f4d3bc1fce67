"""``make test-arm64``: the device agent on the boards' architecture, in an emulated userland.

1. An arm64 Debian userland (benchmarks/arm64.py): made once with debootstrap, cached.
2. A wheel of this working tree, installed there with the device extra into a fresh venv.
3. The device tier's own tests (:data:`DEVICE_TESTS`) run there by pytest, without torch: the
   bundle they need is trained here on the host and passed in (``DDNN_TEST_TINY_BUNDLE``).
4. One live replay: Mosquitto, the cloud, the edge and the other views' devices run here; the
   device of view :data:`VIEW` runs in the userland. Every frame that view sees must be fused,
   and the live accuracy and exit shares must equal ``ddnn evaluate``'s.

Prints ``test-arm64: skipped: WHY`` and exits 0 when this machine cannot run the userland (not
root, tools not installable, no binfmt_misc); ``DDNN_ARM64_REQUIRED=1`` makes that a failure.
Writes what it measured (times, the arm64 device's memory) to build/arm64/report.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ddnn.benchmarks.arm64 import VENV, Userland, UserlandError
from ddnn.benchmarks.device_footprint import MemoryWatch
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.tools.broker import free_port, start_broker
from ddnn.tools.evaluate import evaluate
from ddnn.topics import default_device_ids
from tests.support.data import make_tiny_data, mixed_thresholds, train_tiny_bundle
from tests.support.polling import wait_for as wait_until
from tests.support.processes import ddnn_process, http_ok, read_results, stop_process

REPO = Path(__file__).resolve().parents[2]
REPORT = REPO / "build" / "arm64" / "report.json"
# The device tier's own tests: the unit tests of device/ (tests/unit/test_arm64_selection.py
# checks that every unit test importing ddnn.device is here) and those of the contract and
# plumbing the agent runs on a board. They need the device extra and pytest, never torch.
DEVICE_TESTS = (
    "test_camera_clock_skew.py", "test_coalescer.py", "test_device_buffer.py",
    "test_device_http_transport.py", "test_device_settings.py", "test_device_sources.py",
    "test_device_spool.py", "test_gateway_parts.py", "test_ota_probation.py",
    # the contract: features packed to bits, envelopes, exits, replay files, names
    "test_aggregation.py", "test_batch.py", "test_codec.py", "test_dataset.py",
    "test_envelope.py", "test_exits.py", "test_topics.py", "test_versions.py",
    # plumbing: MQTT, HTTP keep-alive, retries, over-the-air announcements
    "test_alias_bookkeeping.py", "test_keepalive.py", "test_ota_announcement.py",
    "test_retry.py",
)
TEST_REQUIREMENTS = ("pytest>=8", "pytest-timeout>=2.3", "hypothesis>=6.100")
VIEW = 0  # the view whose device runs on aarch64
FPS = 20  # slow enough for the emulated device to keep up with the host's
DEPLOYMENT = "arm64"
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class Steps:
    """Seconds each step took, for the report."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def run(self, name: str, fn, *args):
        print(f"test-arm64: {name}", flush=True)
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.seconds[name] = round(time.monotonic() - start, 1)


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", str(REPO), "-w",
                    str(out)], check=True)
    return next(out.glob("ddnn-*.whl"))


def fixtures(work: Path):
    """The tests' tiny data and bundle (tests/conftest.py's recipe), made on the host."""
    data = make_tiny_data(work)
    return data, train_tiny_bundle(data, work / "tiny")


def device_tests(userland: Userland, work: Path, bundle: Path) -> None:
    """pytest in the userland on a copy of tests/: the installed ddnn, not the source tree."""
    check = work / "check"
    shutil.copytree(REPO / "tests", check / "tests",
                    ignore=shutil.ignore_patterns("__pycache__", "arm64"))
    shutil.copy2(REPO / "pyproject.toml", check)
    argv = [f"{VENV}/bin/python", "-m", "pytest", "-q", "-p", "no:cacheprovider",
            *(f"tests/unit/{name}" for name in DEVICE_TESTS)]
    env = {**ENV, "DDNN_TEST_TINY_BUNDLE": str(bundle)}
    code = subprocess.run(userland.command(argv, binds=[work], env=env, cwd=str(check))
                          ).returncode
    if code != 0:
        raise AssertionError(f"the device tests failed on aarch64 (pytest exit {code})")


def live_replay(userland: Userland, work: Path, bundle: Path, data: Path) -> dict:
    """One replay with view :data:`VIEW`'s device in the userland; returns what it checked."""
    thresholds = mixed_thresholds(bundle, data)
    expected = evaluate(bundle, data, thresholds["local"], thresholds["edge"])
    ds = load_dataset(data)
    views = load_bundle(bundle).manifest.views
    ids = default_device_ids(views)
    results = work / "results.jsonl"
    device = ["device", "--bundle", str(bundle), "--data", str(data), "--fps", str(FPS),
              "--deployment", DEPLOYMENT, "--wait-peers", "300", "--grace", "1",
              "--threads", "1",
              # every frame, however late (an emulated device is slow): compared frame by frame
              "--max-lag-ms", "0"]
    # The devices' spools (on by default) in this run's folder, never the user's state.
    os.environ["XDG_STATE_HOME"] = state = str(work / "state")
    procs: list[subprocess.Popen] = []
    with start_broker(prefer="mosquitto") as broker:
        try:
            cloud = f"http://127.0.0.1:{free_port()}"
            procs.append(ddnn_process(["cloud", "--bundle", str(bundle), "--host", "127.0.0.1",
                                       "--port", cloud.rsplit(":", 1)[1], "--ort-threads", "1"],
                                      work / "cloud.log"))
            wait_until(lambda: http_ok(f"{cloud}/v2/health/ready"), 120, "cloud ready", procs)
            edge_http = free_port()
            procs.append(ddnn_process(
                ["edge", "--bundle", str(bundle), "--broker", broker.url, "--cloud", cloud,
                 "--deployment", DEPLOYMENT, "--deadline-ms", "3000",
                 "--feature-deadline-ms", "3000", "--results-out", str(results),
                 "--http-port", str(edge_http), "--local-threshold", repr(thresholds["local"]),
                 "--edge-threshold", repr(thresholds["edge"])], work / "edge.log"))
            wait_until(lambda: http_ok(f"http://127.0.0.1:{edge_http}/healthz"), 120,
                       "edge ready", procs)
            with open(work / "device-arm64.log", "wb") as log:
                arm = subprocess.Popen(
                    userland.command([f"{VENV}/bin/python", "-m", "ddnn", *device, "--broker",
                                      broker.url, "--view", str(VIEW)], binds=[work],
                                     env={**ENV, "XDG_STATE_HOME": state}),
                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            procs.append(arm)
            watch = MemoryWatch(arm, emulated=True, every=0.2).start()
            devices = [ddnn_process([*device, "--broker", broker.url, "--view", str(v)],
                                    work / f"device{v}.log") for v in range(views) if v != VIEW]
            procs += devices
            wait_until(lambda: len(read_results(results)) >= ds.num_samples, 600,
                       f"{ds.num_samples} results", procs)
            codes = [p.wait(120) for p in [arm, *devices]]
            memory = watch.stop()
        finally:
            for p in reversed(procs):
                stop_process(p)
    if any(codes):
        raise AssertionError(f"device exit codes {codes} (aarch64 first); logs in {work}")
    return _check(read_results(results), ds, ids[VIEW], expected, memory)


def _check(results: list[dict], ds, device_id: str, expected: dict, memory: dict) -> dict:
    by_frame = {r["frame"]: r for r in results}
    n = ds.num_samples
    if sorted(r["frame"] for r in results) != list(range(n)):
        raise AssertionError("not every frame got exactly one result")
    seen = np.flatnonzero(ds.present[:, VIEW])
    unfused = [int(f) for f in seen if device_id not in by_frame[f]["views"]]
    if unfused:
        raise AssertionError(f"{device_id} (aarch64) not fused in frames {unfused[:20]}: "
                             f"{[by_frame[f]['missing'] for f in unfused[:5]]}")
    pred = np.array([by_frame[f]["class"] for f in range(n)])
    accuracy = float((pred == ds.label).mean())
    exits = {t: sum(r["exit"] == t for r in results) / n for t in ("local", "edge", "cloud")}
    if accuracy != expected["accuracy"]["overall"] or any(
            abs(exits[t] - expected["exit_fraction"][t]) > 1e-12 for t in exits):
        raise AssertionError(f"live accuracy {accuracy} and exits {exits} differ from ddnn "
                             f"evaluate's {expected['accuracy']['overall']} and "
                             f"{expected['exit_fraction']}")
    if any(r["degraded"] for r in results):
        raise AssertionError("degraded frames in the live replay")
    return {"frames": n, "frames_seen_by_arm64_view": len(seen), "fused": len(seen),
            "accuracy": accuracy, "evaluate_accuracy": expected["accuracy"]["overall"],
            "exit_fraction": exits, "arm64_device_memory": memory}


def main() -> int:
    start = time.monotonic()
    userland = Userland()
    steps = Steps()
    why = steps.run("checking the host (root, debootstrap, qemu-user-static, binfmt_misc)",
                    userland.host_problem)
    if why:
        print(f"test-arm64: skipped: {why}", flush=True)
        return 1 if os.environ.get("DDNN_ARM64_REQUIRED") == "1" else 0
    built = steps.run(f"the arm64 userland in {userland.root}", userland.build)
    with tempfile.TemporaryDirectory(prefix="ddnn-arm64-") as tmp, \
            ThreadPoolExecutor(1) as pool:
        work = Path(tmp)
        # Training here (torch) while the userland installs (one emulated core): both at once.
        made = pool.submit(steps.run, "the test data and bundle, trained here (torch)",
                           fixtures, work)
        wheel = steps.run("a wheel of the working tree", build_wheel, work / "dist")
        steps.run("installing it with the device extra in the userland", userland.install,
                  wheel, TEST_REQUIREMENTS)
        data, bundle = made.result()
        steps.run("the device tests on aarch64", device_tests, userland, work, bundle)
        replay = steps.run(f"a live replay, view {VIEW}'s device on aarch64", live_replay,
                           userland, work, bundle, data.test)
    report = {"userland": str(userland.root), "userland_built_now": built,
              "seconds": steps.seconds, "total_seconds": round(time.monotonic() - start, 1),
              "device_tests": len(DEVICE_TESTS), "replay": replay}
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(json.dumps(report, indent=2) + "\n")
    memory = replay["arm64_device_memory"]
    print(f"test-arm64: passed in {report['total_seconds']:.0f} s "
          f"({'userland built now' if built else 'userland cached'}): view {VIEW}'s device on "
          f"aarch64 fused in all {replay['fused']} frames it saw, live accuracy "
          f"{replay['accuracy']:.4f} = ddnn evaluate's; its memory {memory['peak_guest_mib']} "
          f"MiB ({memory['peak_rss_mib']} MiB with qemu); report in {REPORT}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (AssertionError, UserlandError) as e:
        print(f"test-arm64: FAILED: {e}", flush=True)
        sys.exit(1)
