"""Live escalation: devices, an edge and the cloud (threads and a real broker) on a bundle that
escalates, answering every frame as ``ddnn evaluate`` does at escalation level 1, and counting
the details on the wire as its byte accounting does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.edge.escalation import senders
from ddnn.exits import entropy_of_logits
from ddnn.runtime import BundleRuntime
from ddnn.tools.broker import start_broker
from tests.support.cloud import real_cloud
from tests.support.data import at_level, mixed_thresholds
from tests.support.hierarchy import check_against_evaluate, replay

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def two_surest(tiny_data, tmp_path_factory) -> Path:
    """A bundle whose escalated cloud reads the details of the two surest views (torch)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig

    out = tmp_path_factory.mktemp("two") / "esc2"
    build_bundle(tiny_data.train, out, DDNNConfig.from_flat(epochs=1, batch_size=32, seed=0,
                                                   escalate="view", escalate_views=2),
                 name="esc2", version="1", progress=False, log=lambda *_: None)
    return out


# Weights strictly between 0 and 1: the escalated answer stacks with its own weight on the
# edge's, itself stacked on the local answer.
STACKED = {"edge": 0.5, "cloud": 0.3, "escalated": 0.4}


@pytest.mark.parametrize(("k", "stacking"), [(0, None), (2, None), (0, STACKED)],
                         ids=["every-view", "two-surest", "every-view-stacked"])
def test_escalated_frames_answer_like_evaluate(mosquitto, kinds_repository, two_surest,
                                               tiny_data, tmp_path, k, stacking):
    trained = two_surest if k else kinds_repository / "esc"
    bundle = at_level(trained, tmp_path / "esc", 1, k, stacking)
    thresholds = mixed_thresholds(bundle, tiny_data.test)
    with real_cloud(bundle) as cloud:
        edge, _ = replay(bundle, tiny_data.test, mosquitto.url, cloud.url,
                         deployment=f"esc{k}", thresholds=thresholds)
    results, m = edge.agg.results, edge.agg.metrics
    expected = check_against_evaluate(results, bundle, tiny_data.test, thresholds)
    assert expected["escalation"]["level"] == 1
    assert load_bundle(bundle).manifest.escalation_views == k
    # Each frame that went up got the escalated model's answer (not the plain cloud's: on
    # this barely trained bundle the two differ on every frame).
    ds = load_dataset(tiny_data.test)
    exits = BundleRuntime(load_bundle(bundle), threads=1).run_dataset(ds.X, ds.present)
    up = [r for r in results if r["exit"] == "cloud"]
    assert [r["class"] for r in up] == [int(np.argmax(exits["escalated"][r["frame"]]))
                                        for r in up]
    cloud_frames = len(up)
    assert m.detail_requests.value() == cloud_frames > 0, "one detail pull per escalated frame"
    assert m.cloud.value(outcome="ok") > 0 and m.cloud.value(outcome="no_escalated") == 0
    assert m.missing.value(stage="detail") == 0
    # Every byte the devices sent, details included, is what evaluate's accounting counts.
    payload = sum(m.bytes.value(kind=k, part="payload")
                  for k in ("scores", "features", "absent", "detail"))
    assert m.bytes.value(kind="detail", part="payload") > 0
    assert payload / 120 == pytest.approx(expected["bytes_per_frame"]["ddnn"], abs=1e-9)


def test_a_cloud_without_the_escalated_model_answers_degraded(mosquitto, kinds_repository,
                                                              tiny_bundle, tiny_data, tmp_path):
    """The edge escalates, but its cloud serves another bundle's models only: every escalated
    frame is answered, from the plain cloud segment of its own version if served, else from
    the edge exit, and flagged degraded."""
    bundle = at_level(kinds_repository / "esc", tmp_path / "esc", 1)
    thresholds = mixed_thresholds(bundle, tiny_data.test)
    plain = tmp_path / "plain"
    shutil.copytree(bundle, plain)
    d = json.loads((plain / "manifest.json").read_text())
    d.pop("escalation", None)
    d["segments"].pop("escalated", None)
    (plain / "manifest.json").write_text(json.dumps(d, indent=2))
    with real_cloud(plain) as cloud:
        edge, _ = replay(bundle, tiny_data.test, mosquitto.url, cloud.url, deployment="plain",
                         thresholds=thresholds)
    results, m = edge.agg.results, edge.agg.metrics
    assert sorted(r["frame"] for r in results) == list(range(120))
    up = [r for r in results if r["exit"] == "cloud"]
    assert up and all(r["degraded"] for r in up)
    assert m.cloud.value(outcome="no_escalated") > 0 and m.cloud.value(outcome="ok") > 0


def test_senders_are_the_surest_present_views():
    scores = {0: np.array([0.1, 0.0, 0.0]), 2: np.array([5.0, 0.0, 0.0]),
              3: np.array([2.0, 0.0, 0.0]), 5: np.array([5.0, 0.0, 0.0])}
    assert senders(scores, 0) == (0, 2, 3, 5)  # every present view, in view order
    assert senders(scores, 2) == (2, 5)  # the surest; a tie goes to the lower view
    assert senders(scores, 9) == (2, 5, 3, 0)
    assert senders({}, 2) == ()
    eta = entropy_of_logits(np.stack([scores[v] for v in (2, 3)]))
    assert eta[0] < eta[1]


def test_devices_behind_a_gateway_escalate_too(mosquitto, kinds_repository, tiny_data,
                                               tmp_path):
    """A gateway forwards the detail pulls to its devices and groups their details as it
    groups pulled features: the answers are evaluate's, no detail misses its deadline."""
    bundle = at_level(kinds_repository / "esc", tmp_path / "esc", 1)
    thresholds = mixed_thresholds(bundle, tiny_data.test)
    with start_broker(prefer="mosquitto") as site, real_cloud(bundle) as cloud:
        edge, _ = replay(bundle, tiny_data.test, mosquitto.url, cloud.url, deployment="gwesc",
                         thresholds=thresholds, site=site.url)
    check_against_evaluate(list(edge.agg.results), bundle, tiny_data.test, thresholds)
    m = edge.agg.metrics
    assert m.detail_requests.value() > 0 and m.missing.value(stage="detail") == 0
    assert m.bytes.value(kind="detail", part="payload") > 0
