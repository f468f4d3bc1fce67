"""Automatic rollback of an over-the-air update that fails its health check, with real processes
(``ddnn cloud --repository``, ``ddnn edge``, three ``ddnn device``; every version signed):

* version 2's edge segment loads but raises at run time, so every frame that reaches it fails:
  the edge rolls back to version 1 during its probation and answers again. The devices, whose
  segments work, keep version 2, and the edge keeps taking their messages;
* the edge is restarted: the retained announcement still names version 2, which stays refused;
* version 3 (newer) is still applied by the edge, and passes. Its device-0 segment raises, which
  ends that device's process; restarted (as systemd would), the device rolls version 3 back at
  start and runs version 2, the last version it knew good (not its --bundle, version 1), without
  applying 3 again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from ddnn.segment import sha256_file
from ddnn.signing import generate_keypair, sign_bundle
from ddnn.tools.broker import free_port
from tests.support.data import version_copy
from tests.support.polling import wait_for
from tests.support.processes import (
    Deployment,
    Statuses,
    announce,
    metric,
    start_cloud_repository,
    stop_process,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

PROBATION = "4"  # seconds; failing for 1 s of it rolls back


def break_segment(bundle: Path, file: str, key: Path) -> None:
    """Replace one segment by a graph that loads but raises at run time (a Reshape to a shape
    no input fits), with its checksum in the manifest, and sign the bundle again."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    mf = bundle / "manifest.json"
    d = json.loads(mf.read_text())
    spec = next(s for s in [*d["segments"]["device"], d["segments"]["edge"]]
                if s["file"] == file)
    name = spec["inputs"][0]["name"]
    x = helper.make_tensor_value_info(name, TensorProto.FLOAT, spec["inputs"][0]["shape"])
    outs = [helper.make_tensor_value_info(o["name"], TensorProto.FLOAT, None)
            for o in spec["outputs"]]
    impossible = numpy_helper.from_array(np.array([-1, 7777], np.int64), "impossible")
    nodes = [helper.make_node("Reshape", [name, "impossible"], ["r"]),
             *(helper.make_node("Identity", ["r"], [o["name"]]) for o in spec["outputs"])]
    model = helper.make_model(helper.make_graph(nodes, "broken", [x], outs, [impossible]),
                              opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, bundle / file)
    spec["sha256"], spec["size"] = sha256_file(bundle / file), (bundle / file).stat().st_size
    mf.write_text(json.dumps(d, indent=2))
    sign_bundle(bundle, key)


def healthz(url: str) -> dict:
    """The edge's /healthz body, 200 or 503."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


@pytest.mark.slow
def test_an_update_failing_its_health_check_is_rolled_back(mosquitto, tiny_bundle, stream_data,
                                                           tmp_path):
    key, pub = generate_keypair(tmp_path / "keys")
    repo = tmp_path / "repo"
    repo.mkdir()
    version_copy(tiny_bundle, repo / "tiny-1", "1", key)
    break_segment(version_copy(tiny_bundle, repo / "tiny-2", "2", key), "edge.onnx", key)
    break_segment(version_copy(tiny_bundle, repo / "tiny-3", "3", key), "device-0.onnx", key)
    v1 = version_copy(tiny_bundle, tmp_path / "running" / "tiny", "1", key)
    port = free_port()
    cloud_url = f"http://127.0.0.1:{port}"
    cloud = start_cloud_repository(repo, port, tmp_path / "cloud.log", "--bundle-key", str(pub))
    # Every frame goes through the edge segment and exits there: version 2 fails them all.
    d = Deployment(tmp_path, v1, mosquitto.url, cloud_url,
                   thresholds={"local": 0.0, "edge": 1.0})
    d.edge_args += ["--bundle-key", str(pub), "--ota-probation", PROBATION]
    device_args = ["--bundle-key", str(pub), "--ota-probation", PROBATION]
    statuses = Statuses(mosquitto.url)
    try:
        d.start_edge()
        for v in range(3):
            d.start_device(v, stream_data, 10, "--wait-peers", "60", *device_args)
        d.wait(lambda r: len(r) >= 20, "20 results")

        announce(mosquitto.url, "2", cloud_url)
        wait_for(lambda: "rolled back tiny:2" in d.log("edge0"), 60, "the edge rolling back",
                   d.procs)
        text, health = d.metrics(), healthz(d.http)
        after = len(d.results())
        d.wait(lambda r: len(r) >= after + 20, "answers on version 1 again")
        wait_for(lambda: statuses.models() == {"tiny:2"}, 60, "the devices on version 2",
                   d.procs)

        assert stop_process(d.edge) == 0
        d.start_edge()
        restarted = len(d.results())
        d.wait(lambda r: len(r) >= restarted + 20, "answers from the restarted edge")
        wait_for(lambda: "not applying tiny:2: rolled back here before" in d.log("edge1"), 30,
                   "the retained version 2 skipped", d.procs)
        text_restarted = d.metrics()

        announce(mosquitto.url, "3", cloud_url)
        wait_for(lambda: "tiny:3 passed its probation" in d.log("edge1"), 60,
                   "version 3 applied by the edge and passed", d.procs[:1])
        crashed = d.devices.pop(0)  # its segment raises: the process ends
        wait_for(lambda: crashed.poll() is not None, 60, "device 0 failing on version 3")
        crash_log = d.log("device0")
        d.start_device(0, stream_data, 10, "--wait-peers", "0", "--limit", "20", *device_args)
        # Its retained status says what it runs and what it rolled back.
        wait_for(lambda: statuses.seen.get("cam0", {}).get("rolled_back_from") == "tiny:3",
                   30, "device 0's status naming the rollback")
        status = dict(statuses.seen["cam0"])
        assert d.devices[-1].wait(60) == 0, d.log("device0")
        restart_log = d.log("device0")
    finally:
        statuses.client.stop()
        d.stop()
        stop_process(cloud)

    assert metric(text, 'ddnn_edge_bundle_updates_total{result="rolled_back"}') == 1
    assert metric(text, 'ddnn_edge_bundle_info{model="tiny",version="1"}') == 1
    assert metric(text, 'ddnn_edge_dropped_total{reason="processing_failed"}') >= 1, \
        "frames failed on version 2 before the rollback"
    assert "tiny:2 is on probation" in d.log("edge0")
    assert health["bundle"]["running"] == "tiny:1" and health["bundle"]["probation"] is None
    assert health["bundle"]["rolled_back_from"] == "tiny:2"
    assert "frames failed in the edge's segments" in health["bundle"]["rollback_reason"]
    assert metric(text_restarted, 'ddnn_edge_bundle_info{model="tiny",version="1"}') == 1
    assert metric(text_restarted, 'ddnn_edge_bundle_updates_total{result="applied"}') == 0
    assert metric(text_restarted, 'ddnn_edge_dropped_total{reason="model"}') == 0, \
        "the devices' messages of version 2 are still taken"
    for v in (1, 2):
        assert "tiny:2 passed its probation" in d.log(f"device{v}"), v
    assert "tiny:2 passed its probation" in crash_log
    assert crashed.returncode != 0 and "tiny:3 is on probation" in crash_log
    assert "rolled back tiny:3: the process ended during its probation" in restart_log
    assert "not applying tiny:3: rolled back here before" in restart_log
    assert "bundle updated over the air" not in restart_log
    assert "resuming tiny:2, the version this tier ran before its restart" in restart_log
    assert status["model"] == "tiny:2" and "ended during its probation" in status["ota_error"]
