"""The gateway's bounds against a hostile site broker, without brokers."""

from __future__ import annotations

import json

import numpy as np

from ddnn import envelope as env
from ddnn.batch import MAX_ENTRIES, MAX_ENTRY, batches, pack_batch, unpack_batch
from ddnn.device.gateway.service import GatewayService
from ddnn.device.gateway.settings import MAX_DEVICES, GatewaySettings
from ddnn.envelope import MAX_MESSAGE, MessageType


def _gateway(**settings) -> GatewayService:
    return GatewayService(GatewaySettings(local="mqtt://127.0.0.1:1", broker="mqtt://127.0.0.1:2",
                                          **settings))


def test_batches_stay_within_the_format_s_bounds():
    small = [("cam0", b"x" * 10, i) for i in range(MAX_ENTRIES + 10)]
    assert [len(b) for b in batches(small)] == [MAX_ENTRIES, 10]
    big = [(f"cam{i}", bytes(MAX_ENTRY * 2 // 3), i) for i in range(5)]  # one per batch
    cut = batches(big)
    assert [len(b) for b in cut] == [1, 1, 1, 1, 1]
    for b in cut:  # each packs, and round-trips
        data = pack_batch((d, e) for d, e, _ in b)
        assert len(data) <= MAX_MESSAGE and unpack_batch(data)[0][0] == b[0][0]
    assert len(pack_batch([("a" * 64, bytes(MAX_ENTRY))])) <= MAX_MESSAGE


def test_only_pull_masks_are_remembered_and_they_are_bounded():
    g = _gateway()
    scores = env.encode(env.pack(MessageType.SCORES, version="1", frame=1,
                                 tensor=np.zeros((1, 3), np.float32), codec="float16"))
    huge = env.encode(env.pack(MessageType.REQUEST, version="1", frame=2,
                               tensor=np.ones(4096, np.float32), codec="binary"))
    mask = env.encode(env.pack(MessageType.REQUEST, version="1", frame=3,
                               tensor=np.array([1, -1, 1], np.float32), codec="binary"))
    for payload in (scores, huge, mask, b"junk"):
        g._remember_pull(payload)
    assert g._pulled == {3: bytes([0b10100000])}
    for frame in range(g.coalescer.max_groups + 5):
        g._remember_pull(env.encode(env.pack(MessageType.REQUEST, version="1", frame=frame,
                                             tensor=np.ones(3, np.float32), codec="binary")))
    assert len(g._pulled) == g.coalescer.max_groups


def test_statuses_keep_what_the_edge_reads_for_a_bounded_set_of_devices():
    g = _gateway()
    noisy = {"state": "online", "view": 1, "mode": "pull", "junk": "x" * 10_000}
    g._device_status("cam1", json.dumps(noisy).encode())
    assert g.statuses == {"cam1": {"state": "online", "view": 1, "mode": "pull"}}
    for i in range(MAX_DEVICES + 50):
        if g._forwards(f"fake{i}"):
            g._device_status(f"fake{i}", b"online")
    assert len(g.statuses) == MAX_DEVICES
    listed = _gateway(devices=("cam0",))
    assert listed._forwards("cam0") and not listed._forwards("cam1")


def test_a_batch_the_edge_s_broker_refused_stays_on_the_site_broker():
    g = _gateway()
    acked = []
    g.local.ack = acked.append
    g._batches = {5: [(50, 1), (51, 1)], 6: [(60, 1)]}
    for ack in ((5, False), (6, True), None):
        g._acks.put(ack)
    g._acknowledge()
    assert acked == [(60, 1)] and g.forwarded["refused"] == 2 and not g._batches
