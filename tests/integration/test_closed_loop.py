"""The loop, closed, live: a hierarchy serving its home domain sees the scene drift, raises the
drift alarm, gets labelled frames from an operator (``POST /v1/feedback``) and a site's labelled
file, federates them with ``ddnn federate`` (real Flower processes, as a user runs it), and rolls
the new signed version out over the air (``ddnn announce``; the cloud's repository, the edge and
every device take it, each through its probation); the drifted scene is then answered better.

Devices in this process (threads) watch a camera folder each (``--images DIR --follow``), which
the test fills as a capture tool would, so the same devices serve before and after the update;
an image's modification time sets its frame id (``frame_slot``), the same on every camera.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("PIL")

from ddnn.benchmarks.closed_loop import CameraFolders
from ddnn.bundle import load_bundle
from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.signing import generate_keypair, sign_bundle
from ddnn.tools.evaluate import evaluate
from tests.support.data import DRIFT_SCENE
from tests.support.hierarchy import REPLAY_WAIT, Edge
from tests.support.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")]

ROOT = Path(__file__).resolve().parents[2]
DRIFTS = ("lighting", "rotation", "remount")
HOME, DRIFTED, AFTER = 100, 300, 200  # frames: the home domain, the drift, after the update
LABELLED = 120  # of the drifted frames, those the operator labels (all within --keep)
SITE = 400  # labelled frames in the site's file
AUDIT, BUDGET = 0.5, 0.02  # as tests/integration/test_drift.py: a false alarm is unlikely
PROBATION = 2.0  # seconds each tier watches the new version before it is kept
OPERATOR = "operator-0123456789abcdef"
FEDERATE = ["--rounds", "2", "--epochs", "6", "--lr", "0.005", "--batch-size", "32"]


@pytest.fixture(scope="module")
def field(tmp_path_factory, drift_home_bundle):
    """The bundle of the home domain (signed), its key, the frames the cameras will see (home,
    drifted, drifted again after the update) and a site's labelled file of the drifted scene."""
    from ddnn.models.synth import (
        SceneConfig,
        apply_drift,
        drifted_config,
        save_dataset,
        synthesize,
    )

    root = tmp_path_factory.mktemp("loop")
    private, public = generate_keypair(root / "keys")
    bundle = Path(shutil.copytree(drift_home_bundle, root / "bundle"))
    sign_bundle(bundle, private)
    cfg = SceneConfig(**DRIFT_SCENE)
    drifted = drifted_config(cfg, DRIFTS)
    frames = {"home": synthesize(HOME, cfg, seed=2),
              "drifted": apply_drift(synthesize(DRIFTED, drifted, seed=3), DRIFTS),
              "after": apply_drift(synthesize(AFTER, drifted, seed=5), DRIFTS)}
    save_dataset(root / "site.npz", apply_drift(synthesize(SITE, drifted, seed=4), DRIFTS))
    save_dataset(root / "after.npz", frames["after"])
    return bundle, private, public, frames, root


def _ddnn(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ddnn", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _accuracy(results: list[dict], frames: range, labels: dict[int, int]) -> float:
    mine = [r for r in results if r["frame"] in frames]
    assert len(mine) == len(frames), "every frame answered once"
    return float(np.mean([r["class"] == labels[r["frame"]] for r in mine]))


def test_the_loop_closes_drift_alarm_feedback_federation_update_recovery(
        mosquitto, cloud_server, field, tmp_path):
    bundle, private, public, frames, root = field
    repository = tmp_path / "repository"
    shutil.copytree(bundle, repository / "field-1")
    cloud = cloud_server(repository=repository, poll_interval=0.2, bundle_key=public,
                         max_queue_delay_ms=5.0)
    shutil.copytree(bundle, tmp_path / "edge" / "field")
    experience = tmp_path / "experience"
    edge = Edge(tmp_path / "edge" / "field", mosquitto.url, cloud, deployment="loop",
                http_port=0, audit_rate=AUDIT, agreement_budget=BUDGET,
                experience=experience, experience_max_mb=64.0, operator_token=OPERATOR,
                bundle_key=public, ota_probation=PROBATION)
    views = edge.agg.manifest.views
    cameras = CameraFolders(tmp_path / "cameras", views)
    with contextlib.ExitStack() as stack:
        stack.callback(edge.stop)
        agg, series = edge.agg, edge.agg.metrics.learning
        devices = []
        for v in range(views):
            shutil.copytree(bundle, tmp_path / f"dev{v}" / "field")
            devices.append(stack.enter_context(DeviceService.from_settings(DeviceSettings(
                bundle=tmp_path / f"dev{v}" / "field", view=v, broker=mosquitto.url,
                deployment="loop", images=cameras.dirs[v], follow=True, fps=0,
                bundle_key=public, ota_probation=PROBATION, keepalive=5, reconnect_max=1,
                peers=tuple(f"cam{i}" for i in range(views)), wait_peers=20))))
        threads = [threading.Thread(target=d.run) for d in devices]
        for t in threads:
            t.start()
        for d, t in zip(devices, threads, strict=True):
            stack.callback(t.join, 30)
            stack.callback(d.stop_event.set)  # (a followed folder stops waiting too)

        # 1. The home domain: answered as trained, no alarm.
        home = cameras.show(frames["home"])
        wait_for(lambda: agg.answered == len(home), REPLAY_WAIT, "the home domain answered")
        assert not agg.snapshot().drift["alarm"]
        home_accuracy = _accuracy(agg.results, home, cameras.labels)

        # 2. The scene drifts: the early exits disagree with the cloud, the alarm rises.
        drifted = cameras.show(frames["drifted"])
        wait_for(lambda: agg.answered == len(home) + len(drifted), REPLAY_WAIT,
                 "the drifted scene answered")
        status = wait_for(lambda: (s := agg.snapshot().drift)["alarm"] and s, 10,
                          "the drift alarm")
        assert drifted.start <= status["alarm_raised_at_frame"] < drifted.stop
        assert series.drift_alarm.get() == 1
        warnings = edge.service.health.readiness().details["warnings"]
        assert any(w.startswith("drift:") for w in warnings), warnings
        before = _accuracy(agg.results, drifted, cameras.labels)
        assert before < home_accuracy - 0.2, (home_accuracy, before)

        # 3. An operator labels the last drifted frames (within the devices' --keep window).
        url = f"{edge.service.http.url}/v1/feedback"
        classes = agg.manifest.classes
        for f in drifted[-LABELLED:]:
            _label(url, f, classes[cameras.labels[f]])
        assert series.feedback.value(outcome="recorded") == LABELLED
        # The labels are written at once; the cloud's answers in chunks (256 frames, or every
        # 30 s): the federation learns from those written by then, as an operator's would.
        wait_for(lambda: _labelled_on_disk(experience) == LABELLED, 30, "the labels written")

        # 4. The sites federate: the edge's experience and a site's labelled file.
        out = tmp_path / "federated"
        run = _ddnn("federate", "--bundle", str(bundle), "--site", str(experience),
                    "--site", str(root / "site.npz"), "--out", str(out), "--key", str(private),
                    "--json", *FEDERATE, timeout=800)
        assert run.returncode == 0, run.stderr[-3000:]
        result = json.loads(run.stdout.strip().splitlines()[-1])
        version = result["version"]
        assert version != "1" and load_bundle(out, public_key=public).manifest.version == version

        # 5. Over the air: into the cloud's repository, announced, taken by every tier.
        shutil.copytree(out, repository / f"field-{version}")
        wait_for(lambda: _served(cloud, version), 30, "the cloud serving the new version")
        announce = _ddnn("announce", "--broker", mosquitto.url, "--deployment", "loop",
                         "--name", "field", "--version", version, "--cloud", cloud, timeout=60)
        assert announce.returncode == 0, announce.stderr[-2000:]
        updaters = [edge.service.updater, *(d.updater for d in devices)]
        wait_for(lambda: all(u.running.manifest.version == version
                             and u.status()["probation"] is None for u in updaters), 120,
                 "every tier running the new version past its probation")
        assert all(u.status().get("rolled_back_from") is None for u in updaters)

        # 6. The drifted scene again, new frames: answered better.
        after = cameras.show(frames["after"])
        wait_for(lambda: agg.answered == after.stop - home.start, REPLAY_WAIT, "the frames after")
        recovered = _accuracy(agg.results, after, cameras.labels)
        offline_before = evaluate(bundle, root / "after.npz")["accuracy"]["overall"]
        assert recovered >= before + 0.15, (before, recovered)
        assert recovered >= offline_before + 0.15, (offline_before, recovered)
        assert agg.snapshot().manifest.version == version
        assert _cloud_answered(cloud, version) > 0  # the edge's calls, by the new version
        assert not any(r["degraded"] for r in agg.results)


def _label(url: str, frame: int, label: str) -> None:
    """One operator label, again after a 429 (the route allows 10 a second per address)."""
    def post():
        r = httpx.post(url, json={"frame": frame, "label": label},
                       headers={"Authorization": f"Bearer {OPERATOR}"}, timeout=30)
        return None if r.status_code == 429 else r

    r = wait_for(post, 30, f"frame {frame} labelled")
    assert r.status_code == 201, r.text


def _labelled_on_disk(directory: Path) -> int:
    from ddnn.experience import chunks, read_experience

    return int(read_experience(directory).labelled.sum()) if chunks(directory) else 0


def _served(cloud: str, version: str) -> bool:
    r = httpx.get(f"{cloud}/v2/models/field-cloud/versions/{version}/ready", timeout=5)
    return r.status_code == 200


def _cloud_answered(cloud: str, version: str) -> float:
    """Inference requests the cloud answered (200) with ``version`` (its Prometheus text)."""
    text = httpx.get(f"{cloud}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("ddnn_cloud_requests_total{") and f'version="{version}"' in line \
                and 'code="200"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total
