"""An over-the-air update that outlives an outage: the cloud is down when a version is announced,
and the edge restarts meanwhile. The target is kept on disk and retried with backoff; the
restarted edge takes it up again (and keeps taking the devices' messages of both versions);
once the cloud is back every tier applies it, and no frame is lost.

Real processes throughout (``ddnn cloud --repository``, ``ddnn edge``, three ``ddnn device``);
every version is signed.
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
    ddnn_process,
    frames_of,
    http_ok,
    metric,
    stop_process,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


def start_cloud(repo, port, log, pub):

    proc = ddnn_process(["cloud", "--repository", str(repo), "--host", "127.0.0.1", "--port",
                         str(port), "--ort-threads", "1", "--poll-interval", "0",
                         "--bundle-key", str(pub)], log)
    wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/v2/models/tiny-cloud/versions/2/ready"),
               60, "cloud ready", [proc])
    return proc


@pytest.mark.slow
def test_an_update_announced_while_the_cloud_is_down_survives_an_edge_restart(
        mosquitto, tiny_bundle, stream_data, tmp_path):
    key, pub = generate_keypair(tmp_path / "keys")
    repo = tmp_path / "repo"
    repo.mkdir()
    version_copy(tiny_bundle, repo / "tiny-1", "1", key)
    version_copy(tiny_bundle, repo / "tiny-2", "2", key)
    v1 = version_copy(tiny_bundle, tmp_path / "running" / "tiny", "1", key)
    port = free_port()
    cloud_url = f"http://127.0.0.1:{port}"
    cloud = start_cloud(repo, port, tmp_path / "cloud0.log", pub)
    d = Deployment(tmp_path, v1, mosquitto.url, cloud_url,
                   thresholds=mixed_thresholds(v1, stream_data))
    d.edge_args += ["--bundle-key", str(pub), "--ota-retry-max", "1"]
    statuses = Statuses(mosquitto.url)
    target = v1.parent / ".ddnn-ota" / "target-edge0.json"
    try:
        d.start_edge()
        for v in range(3):
            d.start_device(v, stream_data, 10, "--wait-peers", "60", "--bundle-key", str(pub),
                           "--ota-retry-max", "1")
        d.wait(lambda r: len(r) >= 20, "20 results")
        assert stop_process(cloud) == 0
        announce(mosquitto.url, "2", cloud_url)
        wait_for(lambda: "cannot fetch bundle tiny:2 now" in d.log("edge0"), 60,
                   "the edge failing to fetch", d.procs)
        assert target.exists(), "the target is on disk"
        # The edge restarts while the cloud is still down.
        assert stop_process(d.edge) == 0
        restarted_at = len(d.results())
        d.start_edge()
        wait_for(lambda: "cannot fetch bundle tiny:2 now" in d.log("edge1"), 60,
                   "the restarted edge retrying", d.procs)
        assert "resuming the update to tiny:2" in d.log("edge1")
        retries = metric(d.metrics(), 'ddnn_edge_bundle_updates_total{result="retry"}')
        cloud = start_cloud(repo, port, tmp_path / "cloud1.log", pub)
        wait_for(lambda: metric(d.metrics(), 'ddnn_edge_bundle_info{model="tiny",version="2"}')
                   == 1, 60, "the edge on version 2", d.procs)
        wait_for(lambda: statuses.models() == {"tiny:2"}, 60, "every device on version 2",
                   d.procs)
        updated_at = len(d.results())
        d.wait(lambda r: len(r) >= STREAM, f"{STREAM} results")
        d.wait_devices()
        text = d.metrics()
    finally:
        statuses.client.stop()
        d.stop()
        stop_process(cloud)
    assert restarted_at < STREAM and updated_at < STREAM, "all of it while frames flowed"
    assert retries >= 1
    assert frames_of(d.results()) == list(range(STREAM)), "every frame exactly once"
    assert metric(text, 'ddnn_edge_bundle_updates_total{result="applied"}') == 1
    assert metric(text, 'ddnn_edge_dropped_total{reason="model"}') == 0
    assert not target.exists(), "applied: the target is cleared"
    for name in ("edge1", "device0", "device1", "device2"):
        assert "bundle updated over the air: tiny:1 -> tiny:2" in d.log(name), name
