"""Where the edge runs a frame: at once on the thread of its last view; in batches on the
worker when they come close together and their local exit is a numpy call; the answers are the
same either way, and every message and stage of the latency breakdown is counted."""

from __future__ import annotations

import pytest

import ddnn.edge.scheduler as scheduler
from ddnn.bundle import load_bundle
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.edge.settings import EdgeSettings
from ddnn.runtime import BundleRuntime
from ddnn.topics import Topics
from tests.support.polling import wait_for
from tests.support.scores import messages

FRAMES = 12


class Kept:
    def __init__(self): self.results = []
    def start(self): pass
    def publish(self, result): self.results.append(result)
    def close(self): pass


def edge(bundle, threshold: float = 1.0, plain: bool = True) -> tuple[EdgeAggregator, Kept]:
    runtime = BundleRuntime(load_bundle(bundle))
    devices = [f"cam{v}" for v in range(runtime.manifest.views)]
    kept = Kept()
    settings = EdgeSettings(bundle=bundle, http_port=0, local_threshold=threshold,
                            deadline_ms=5000.0)
    agg = EdgeAggregator(runtime, settings, Topics(), devices=devices, sinks=[kept])
    assert agg.pipeline.plain_local, "the tiny bundle's local exit: max, no segment"
    agg.pipeline.plain_local = plain  # False: the numpy local exit (avg, concat, a segment)
    return agg, kept


def answers(kept: Kept) -> list[tuple]:
    # (entropies to 9 places: plain floats and numpy may differ in the last bits)
    return sorted((r.frame, r.cls, r.exit, round(r.entropy, 9), r.views) for r in kept.results)


def test_a_frame_is_answered_on_the_thread_of_its_last_view(tiny_bundle, monkeypatch):
    monkeypatch.setattr(scheduler, "INLINE_GAP", 1e9)  # however close together they come
    agg, kept = edge(tiny_bundle)
    agg.start()
    try:
        for n, (topic, payload) in enumerate(messages(agg, FRAMES)):
            agg.ingest.on_message(topic, payload)
            # No queue and no thread in between: the result is out when the message is taken.
            assert len(kept.results) == (n + 1) // len(agg.devices)
    finally:
        agg.stop()


@pytest.mark.parametrize("threshold", [1.0, 0.0])  # every frame exits; none does (pulls)
def test_frames_close_together_run_in_one_batch_with_the_same_answers(tiny_bundle, threshold,
                                                                      monkeypatch):
    inline, kept_inline = edge(tiny_bundle, threshold)  # in plain floats, one by one
    for topic, payload in messages(inline, FRAMES):
        inline.ingest.on_message(topic, payload)
    batched, kept = edge(tiny_bundle, threshold, plain=False)
    monkeypatch.setattr(scheduler, "INLINE_GAP", 1e9)  # all but the first frame batched
    for topic, payload in messages(batched, FRAMES):
        batched.ingest.on_message(topic, payload)
    assert len(kept.results) == (1 if threshold else 0)  # the rest wait for the worker
    batched.start()  # its first pass runs them, local exits in one call
    try:
        if threshold:
            wait_for(lambda: len(kept.results) == FRAMES)
            assert answers(kept) == answers(kept_inline)
            assert batched.metrics.segment.count(step="local") == 2
        else:  # without features the frames wait at the feature stage, pulled in order
            wait_for(lambda: len(batched.assembler.pending()) == FRAMES)
            assert {f.id for f in batched.assembler.pending()} == set(range(FRAMES))
            assert {f.id for f in inline.assembler.pending()} == set(range(FRAMES))
    finally:
        batched.stop()


def test_messages_and_stages_are_counted(tiny_bundle):
    agg, kept = edge(tiny_bundle)
    agg.start()
    try:
        msgs = messages(agg, 3)
        for topic, payload in msgs:
            agg.ingest.on_message(topic, payload)
        wait_for(lambda: len(kept.results) == 3)
        text = agg.metrics.render()  # counted in plain integers, handed over for a scrape
        assert f'ddnn_edge_messages_total{{kind="scores"}} {len(msgs)}.0' in text
        for stage in ("arrival", "wait", "local"):
            assert f'ddnn_edge_stage_seconds_count{{stage="{stage}"}} 3.0' in text
    finally:
        agg.stop()
    header = sum(len(p) for _, p in msgs) - len(msgs) * 2 * agg.manifest.num_classes
    assert agg.metrics.bytes.value(kind="scores", part="header") == header
