"""Training on the default generated set: time, per-exit accuracy, exit fractions, bytes.

The baseline is raw offload: every present view sent to the cloud as an 8-bit image, answered
by the cloud exit. Both sides come from the same ONNX Runtime evaluation of the same bundle.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ddnn.benchmarks.common import machine, workspace, write_json
from ddnn.tools.evaluate import evaluate


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    ws = workspace(work, quick=quick)
    manifest = json.loads((ws.bundle / "manifest.json").read_text())
    start = time.perf_counter()
    result = evaluate(ws.bundle, ws.test)
    eval_seconds = time.perf_counter() - start
    acc, b = result["accuracy"], result["bytes_per_frame"]
    summary = {
        "machine": machine(),
        "dataset": {"train": str(ws.train), "test": str(ws.test), "samples": result["samples"]},
        "train_seconds": ws.train_seconds
        if ws.train_seconds is not None
        else manifest["training"]["seconds"],
        "epochs": manifest["training"]["epochs"],
        "eval_seconds": round(eval_seconds, 2),
        "evaluation": result,
        "ratios": {
            "uplink_bytes_raw_over_ddnn": b["raw_offload"] / b["ddnn"] if b["ddnn"] else None,
            "overall_minus_cloud_accuracy": acc["overall"] - acc["cloud"],
        },
        "aims": {
            "overall_at_least_cloud": acc["overall"] >= acc["cloud"],
            "local_exit_at_least_70pct": result["exit_fraction"]["local"] >= 0.70,
            "bytes_50x_fewer": b["ddnn"] * 50 <= b["raw_offload"],
        },
    }
    write_json(out_dir, "training", summary)
    return summary
