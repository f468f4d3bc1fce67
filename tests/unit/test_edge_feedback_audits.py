"""A frame the drift monitor audited (answered at the local exit, then sent up to the cloud to
check) can be labelled like any answered frame: the edge remembers it once its answer is out,
and keeps the features pulled for the audit (a device ignores a second pull of a frame)."""

from __future__ import annotations

import numpy as np

from ddnn.bundle import load_bundle
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.edge.feedback import AnsweredMemory
from ddnn.edge.settings import EdgeSettings
from ddnn.runtime import BundleRuntime
from ddnn.topics import Topics
from tests.support.polling import wait_for
from tests.support.scores import messages

TOKEN = "operator-token-0123456789"
FRAMES = 6


class Kept:
    """A sink keeping the results."""

    def __init__(self):
        self.results = []

    def start(self):
        pass

    def publish(self, result):
        self.results.append(result)

    def close(self):
        pass


def test_audited_frames_are_remembered_for_the_operators_labels(tiny_bundle, tmp_path):
    runtime = BundleRuntime(load_bundle(tiny_bundle))
    devices = [f"cam{v}" for v in range(runtime.manifest.views)]
    kept = Kept()
    # Every frame exits locally and every early exit is audited (sent up after its answer).
    settings = EdgeSettings(bundle=tiny_bundle, cloud="http://127.0.0.1:9", http_port=0,
                            local_threshold=1.0, audit_rate=1.0, deadline_ms=5000.0,
                            experience=tmp_path / "experience", operator_token=TOKEN)
    agg = EdgeAggregator(runtime, settings, Topics(), devices=devices, sinks=[kept])
    agg.start()
    try:
        for topic, payload in messages(agg, FRAMES):
            agg.ingest.on_message(topic, payload)
        wait_for(lambda: len(kept.results) == FRAMES, what="every frame answered")
        assert sorted(r.frame for r in kept.results) == list(range(FRAMES))
        assert {r.exit for r in kept.results} == {"local"}
        # Still on their way up (features awaited for the cloud), and labelled like any other.
        assert {f.id for f in agg.assembler.pending()} == set(range(FRAMES))
        assert agg.metrics.learning.audits.value(exit="local") == FRAMES
        memory = agg.answers.memory
        assert memory is not None
        for r in kept.results:
            assert memory.get(r.frame).views == tuple(devices.index(v) for v in r.views)
    finally:
        agg.stop()


def test_features_pulled_after_the_answer_are_kept_for_a_label(tiny_bundle):
    m = load_bundle(tiny_bundle).manifest
    shape = m.devices[0].output("features").sample_shape
    memory = AnsweredMemory(kept=2)
    memory.remember(1, m, (0, 2), {})  # answered at the local exit, before any pull
    memory.add_features(1, {v: np.full(shape, v, np.float32) for v in (0, 1, 2)})
    assert sorted(memory.get(1).features) == [0, 2]  # the answer's views only
    memory.add_features(9, {0: np.zeros(shape, np.float32)})  # never answered: nothing kept
    memory.remember(2, m, (0,), {0: np.zeros(shape, np.float32)})
    memory.remember(3, m, (1,), {})
    memory.add_features(3, {1: np.ones(shape, np.float32)})
    assert memory.get(1).features == {}  # past `kept`: the oldest lose theirs
    assert sorted(memory.get(3).features) == [1] and sorted(memory.get(2).features) == [0]
