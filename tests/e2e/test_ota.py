"""Bundle updates over the air, with real processes: a version announced on the retained bundle
topic is fetched from the cloud, verified and swapped in by the edge and every device while they
run; a tampered version is refused and the running one keeps serving; no frame is lost.

Over-the-air bundles must be signed (ddnn.plumbing.ota): every version here is signed with a
key made for the test, and every tier runs with ``--bundle-key``.
"""

from __future__ import annotations

import pytest

from ddnn.signing import generate_keypair
from ddnn.tools.broker import free_port
from tests.support.data import STREAM, mixed_thresholds, version_copy
from tests.support.polling import wait_for
from tests.support.processes import (
    Deployment,
    Statuses,
    announce,
    frames_of,
    metric,
    start_cloud_repository,
    stop_process,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

@pytest.mark.slow
def test_update_over_the_air_while_running(mosquitto, tiny_bundle, stream_data, tmp_path):
    key, pub = generate_keypair(tmp_path / "keys")
    repo = tmp_path / "repo"
    repo.mkdir()
    version_copy(tiny_bundle, repo / "tiny-1", "1", key)
    v1 = version_copy(tiny_bundle, tmp_path / "running" / "tiny", "1", key)  # the tiers load it
    version_copy(tiny_bundle, repo / "tiny-2", "2", key)
    v3 = version_copy(tiny_bundle, repo / "tiny-3", "3", key)
    port = free_port()
    cloud_url = f"http://127.0.0.1:{port}"
    cloud = start_cloud_repository(repo, port, tmp_path / "cloud.log", "--bundle-key", str(pub))
    # Version 3 is damaged after the cloud loaded it: what it serves fails the checksums.
    onnx = next(v3.glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-10] + b"0123456789")
    thresholds = mixed_thresholds(v1, stream_data)
    d = Deployment(tmp_path, v1, mosquitto.url, cloud_url, thresholds=thresholds)
    d.edge_args += ["--bundle-key", str(pub)]
    statuses = Statuses(mosquitto.url)
    try:
        d.start_edge()
        for v in range(3):
            d.start_device(v, stream_data, 25, "--wait-peers", "60", "--bundle-key", str(pub))
        d.wait(lambda r: len(r) >= 30, "30 results")
        announce(mosquitto.url, "2", cloud_url)
        wait_for(lambda: metric(d.metrics(), 'ddnn_edge_bundle_info{model="tiny",version="2"}')
                   == 1, 60, "the edge on version 2", d.procs)
        wait_for(lambda: statuses.models() == {"tiny:2"}, 60, "every device on version 2",
                   d.procs)
        answered_at_update = len(d.results())
        announce(mosquitto.url, "3", cloud_url)
        wait_for(lambda: metric(d.metrics(), 'ddnn_edge_bundle_updates_total{result="refused"}')
                   >= 1, 60, "the edge refusing version 3", d.procs)
        d.wait(lambda r: len(r) >= STREAM, f"{STREAM} results")
        d.wait_devices()
        text = d.metrics()
    finally:
        statuses.client.stop()
        d.stop()
        stop_process(cloud)
    assert answered_at_update < STREAM, "the update happened while frames were flowing"
    assert frames_of(d.results()) == list(range(STREAM)), "every frame exactly once"
    assert not any(r["degraded"] for r in d.results())
    assert metric(text, 'ddnn_edge_bundle_info{model="tiny",version="2"}') == 1
    assert metric(text, 'ddnn_edge_bundle_info{model="tiny",version="1"}') == 0
    assert metric(text, 'ddnn_edge_bundle_updates_total{result="applied"}') == 1
    assert metric(text, 'ddnn_edge_dropped_total{reason="model"}') == 0
    for name in ("edge0", "device0", "device1", "device2"):
        log = d.log(name)
        assert "bundle updated over the air: tiny:1 -> tiny:2" in log, name
        assert "refused bundle update tiny:3" in log and "still running tiny:2" in log, name
    assert statuses.models() <= {"tiny:2"}


