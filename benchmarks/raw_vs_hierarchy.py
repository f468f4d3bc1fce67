"""The hierarchy against raw offload to the cloud, in one run, through the real services.

* hierarchy: ``ddnn demo`` on the bundle (broker, cloud, edge, one device process per view),
  which reports live accuracy, device uplink payload bytes per frame and latency per exit tier;
* raw offload: one ``ddnn cloud --repository`` serving the hierarchy and its raw-offload
  reference (``ddnn train --baseline``, the model a user would deploy if bandwidth were free)
  side by side; one client sends each frame's views to ``{name}-raw`` (the reference) and to
  ``{name}-full`` (the hierarchy's cloud exit on raw views) over HTTP (binary tensors) and waits
  for the answer. Bytes are counted as 8-bit images of the present views (what a camera would
  send) and, for reference, as the FP32 request body actually sent.
"""

from __future__ import annotations

import http.client
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import stop_process, write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.oip import decode_response, encode_request
from ddnn.tools.broker import free_port, wait_for_port


def _offload(conn: http.client.HTTPConnection, model: str, ds, n: int, with_present: bool
             ) -> dict:
    """Each of the first ``n`` frames sent alone to ``model``: accuracy, latency, body bytes."""
    lat, correct, body_bytes = [], [], []
    for i in range(n):
        present = ds.present[i : i + 1]
        views = np.where(present[..., None, None, None], ds.X[i : i + 1], 0.0).astype(np.float32)
        body, headers = encode_request({"views": views, "present": present} if with_present
                                       else {"views": views})
        start = time.perf_counter()
        conn.request("POST", f"/v2/models/{model}/infer", body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        lat.append((time.perf_counter() - start) * 1e3)
        if resp.status != 200:
            raise RuntimeError(f"cloud answered {resp.status} for {model}: {data[:200]!r}")
        scores = decode_response(data, dict(resp.getheaders()))["scores"]
        if ds.label[i] >= 0:  # (a frame no camera saw has nothing to be right about)
            correct.append(int(scores.argmax()) == int(ds.label[i]))
        body_bytes.append(len(body))
    return {"accuracy": float(np.mean(correct)),
            "latency_ms": {"p50": statistics.median(lat), "p99": float(np.percentile(lat, 99))},
            "http_body_bytes_per_frame_fp32": float(np.mean(body_bytes))}


def _raw_offload(bundle: Path, reference: Path, ds, n: int) -> dict:
    m = load_bundle(bundle).manifest
    repo = Path(tempfile.mkdtemp(prefix="ddnn-raw-vs-"))
    shutil.copytree(bundle, repo / m.name)
    shutil.copytree(reference, repo / f"{m.name}-raw")
    port = free_port()
    cloud = subprocess.Popen(
        [sys.executable, "-m", "ddnn", "cloud", "--repository", str(repo), "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port("127.0.0.1", port, 60, cloud)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        ready = time.monotonic() + 60  # the port opens before the repository is loaded
        while True:
            conn.request("GET", f"/v2/models/{m.name}-raw/ready")
            resp = conn.getresponse()
            resp.read()
            if resp.status == 200:
                break
            if time.monotonic() > ready:
                raise RuntimeError(f"the cloud never served {m.name}-raw")
            time.sleep(0.2)
        reference_result = _offload(conn, f"{m.name}-raw", ds, n, with_present=False)
        full = _offload(conn, f"{m.name}-full", ds, n, with_present=True)
        conn.close()
    finally:
        stop_process(cloud)
        shutil.rmtree(repo, ignore_errors=True)
    raw8 = ds.present[:n].sum(1) * int(np.prod(m.input_shape))
    return {**reference_result, "uplink_bytes_per_frame_8bit": float(raw8.mean()),
            "hierarchy_cloud_exit_on_raw_views": full}


def run(out_dir: Path, bundle: Path, data: Path, quick: bool = False, *,
        reference: Path) -> dict:
    n = 100 if quick else 500
    ds = load_dataset(data, num_classes=load_bundle(bundle).manifest.num_classes)
    n = min(n, ds.num_samples)
    work = Path("runs/bench/raw_vs_hierarchy")
    demo = subprocess.run(
        [sys.executable, "-m", "ddnn", "demo", "--bundle", str(bundle), "--data", str(data),
         "--frames", str(n), "--fps", "25", "--work", str(work)],
        capture_output=True, text=True,
    )
    if demo.returncode != 0:
        raise RuntimeError(f"demo failed: {demo.stderr[-1500:]}")
    hier = json.loads((work / "report" / "summary.json").read_text())
    raw = _raw_offload(bundle, reference, ds, n)
    lat = hier["latency_ms"]
    answered = max(hier["answered"], 1)
    mean_lat = sum(lat[t]["p50"] * hier["exits"][t] for t in lat if lat[t]) / answered
    result = {
        "frames": n,
        "hierarchy": {
            "accuracy": hier["live_accuracy"],
            "uplink_bytes_per_frame": hier["bytes_per_frame"]["live"],
            "exits": hier["exits"],
            "latency_ms_by_exit": lat,
            "latency_ms_p50_weighted": mean_lat,
        },
        "raw_offload": raw,
        "ratios": {
            "bytes_raw_over_hierarchy": raw["uplink_bytes_per_frame_8bit"]
            / max(hier["bytes_per_frame"]["live"] or 1e-9, 1e-9),
            "accuracy_hierarchy_minus_raw": hier["live_accuracy"] - raw["accuracy"],
        },
        "note": "hierarchy frames are replayed at 25 fps by V device processes; raw offload is "
        "one sequential client sending every view to the reference ({name}-raw, trained on the "
        "same file with the same epochs); both on this machine's loopback",
    }
    write_json(out_dir, "raw_vs_hierarchy", result)
    return result
