"""Training on the default generated set: time, per-exit accuracy, exit fractions, bytes.

Trains where ``ddnn train`` does by default (CUDA with bf16 autocast when a GPU is present, else
the CPU) and records which in ``trained_on``. Two baselines, same run, same data: bytes against
raw offload (every present view sent as an 8-bit image), and accuracy against the raw-offload
reference, a float CNN trained by ``ddnn train --baseline`` on the full images of every present
view (``models.baseline``; a bundle of kind ``raw``). The ``tiers`` benchmark does the same on
every set over two seeds.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ddnn.benchmarks.common import machine, reference_bundle, workspace, write_json
from ddnn.tools.evaluate import evaluate


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    ws = workspace(work, quick=quick)
    manifest = json.loads((ws.bundle / "manifest.json").read_text())
    start = time.perf_counter()
    result = evaluate(ws.bundle, ws.test)
    eval_seconds = time.perf_counter() - start
    acc, b = result["accuracy"], result["bytes_per_frame"]
    raw = reference(ws, quick)
    train_seconds = (ws.train_seconds if ws.train_seconds is not None
                     else manifest["training"]["seconds"])
    summary = {
        "machine": machine(),
        "dataset": {"train": str(ws.train), "test": str(ws.test), "samples": result["samples"]},
        "train_seconds": train_seconds,  # `ddnn train` wall time (the loop alone if cached)
        "epochs": manifest["training"]["epochs"],
        # `ddnn train --device auto`: CUDA with bf16 autocast where a GPU is present
        "trained_on": {k: manifest["training"].get(k) for k in ("device", "precision")},
        "eval_seconds": round(eval_seconds, 2),
        "evaluation": result,
        "raw_offload_reference": raw,
        "ratios": {
            "overall_minus_raw_reference": acc["overall"] - raw["test_accuracy"],
            "uplink_bytes_raw_over_ddnn": b["raw_offload"] / b["ddnn"] if b["ddnn"] else None,
            "overall_minus_cloud_accuracy": acc["overall"] - acc["cloud"],
        },
        "aims": {
            "cloud_ge_edge_ge_local": acc["cloud"] >= acc["edge"] >= acc["local"],
            "overall_within_0.3pt_of_raw_reference": acc["overall"] >= raw["test_accuracy"]
            - 0.003,
            "bytes_20x_fewer": b["ddnn"] * 20 <= b["raw_offload"],
            "trains_in_5_min": train_seconds <= 300,
        },
    }
    write_json(out_dir, "training", summary)
    return summary


def reference(ws, quick: bool) -> dict:
    """Train (once, cached) the raw-offload reference bundle on the same files and return its
    training summary, with ``test_accuracy`` on the test file."""
    out = reference_bundle(ws, quick)
    return json.loads((out / "manifest.json").read_text())["training"]
