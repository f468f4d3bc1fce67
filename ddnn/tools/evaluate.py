"""``ddnn evaluate``: run a bundle over a labelled dataset with ONNX Runtime only."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddnn.bundle import Bundle, Manifest, load_bundle
from ddnn.dataset import MultiViewDataset, load_dataset
from ddnn.errors import ConfigError, DatasetError
from ddnn.exits import ExitPolicy
from ddnn.hierarchy import UplinkCost, raw_offload_bytes, summarize
from ddnn.operating_curve import curve_table, frontier, pick_from_table, sweep
from ddnn.runtime import BundleRuntime, SegmentRunner
from ddnn.stacking import summary_line

CURVE_GRID = 101  # thresholds tried per exit for the reported curve


def evaluate(
    bundle_dir: str | Path,
    data: str | Path,
    local_threshold: float | None = None,
    edge_threshold: float | None = None,
    threads: int | None = None,
    max_bytes: float | None = None,
    level: int | None = None,
) -> dict:
    """Evaluate a bundle on a dataset file; returns the contract's JSON object.

    ``max_bytes`` re-picks the thresholds and escalation level from the operating curve the
    bundle's calibration stored (held-out data, never ``data``); explicit thresholds and
    ``level`` override what the bundle (or that pick) says. A raw-offload reference bundle is
    evaluated as the one model it is.
    """
    bundle = load_bundle(bundle_dir, kind=None)
    m = bundle.manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    if ds.num_views != m.views or ds.image_shape != m.input_shape:
        raise DatasetError(
            f"{data}: has {ds.num_views} views of {ds.image_shape}, the bundle expects "
            f"{m.views} views of {m.input_shape}"
        )
    if m.kind == "raw":
        return _evaluate_raw(bundle, ds, threads)
    policy: ExitPolicy = m.policy
    budget = None
    if max_bytes is not None:
        point = pick_from_table(_stored_curve(m, bundle_dir), max_bytes)
        policy, level = ExitPolicy(point.thresholds), point.level if level is None else level
        budget = {"max_bytes": max_bytes, "held_out": point.to_dict()}
    policy = policy.with_overrides(local=local_threshold, edge=edge_threshold)
    if level not in (None, 0, 1) or (level == 1 and m.escalated is None):
        raise ConfigError(f"escalation level must be 0{' or 1' if m.escalated else ''} for "
                          f"this bundle, got {level}")
    exits = BundleRuntime(bundle, threads=threads).run_dataset(ds.X, ds.present)
    result = summarize(exits, ds.label, ds.y, m, policy, level)
    if budget is not None:
        result["budget"] = budget
    result["curve"] = curve_table(frontier(sweep(exits, ds.label, ds.present, UplinkCost.of(m),
                                                 CURVE_GRID)))
    return result


def _stored_curve(m: Manifest, where) -> dict:
    curve = m.calibration.get("curve")
    if not curve:
        raise ConfigError(f"{where}: this bundle stores no operating curve (trained by an older "
                          "ddnn); set --local-threshold and --edge-threshold instead")
    return curve


def _evaluate_raw(bundle: Bundle, ds: MultiViewDataset, threads: int | None) -> dict:
    """Accuracy of a raw-offload reference and the bytes its uplink carries (8-bit views)."""
    spec = bundle.manifest.raw  # type: ignore[attr-defined]
    runner = SegmentRunner(bundle.file(spec), spec, threads)
    scores = np.concatenate([runner(views=ds.X[i : i + 256])["scores"]
                             for i in range(0, ds.num_samples, 256)])
    n_present = ds.present.sum(axis=1)
    seen = n_present > 0
    correct = (scores.argmax(-1) == ds.label)[seen]
    return {
        "kind": "raw",
        "samples": ds.num_samples,
        "no_view": int((~seen).sum()),
        "accuracy": {"overall": float(correct.mean()) if correct.size else 0.0},
        "bytes_per_frame": {"raw_offload": float(raw_offload_bytes(n_present,
                                                                   bundle.manifest.input_shape
                                                                   ).mean())},
    }


def format_table(result: dict) -> str:
    """A readable table of an evaluation result."""
    if result.get("kind") == "raw":
        return (f"samples: {result['samples']} (raw-offload reference)\n"
                f"accuracy: {result['accuracy']['overall']:.3f}\n"
                f"uplink bytes per frame: {result['bytes_per_frame']['raw_offload']:.1f} "
                "(every present view as an 8-bit image)")
    acc, frac = result["accuracy"], result["exit_fraction"]
    th = result["thresholds"]
    lines = [
        f"samples: {result['samples']}" + (f" ({result['no_view']} seen by no view)"
                                           if result.get("no_view") else ""),
        "",
        f"{'exit':<9}{'accuracy':>10}{'exit fraction':>15}{'threshold':>11}",
        f"{'device':<9}{acc['device']:>10.3f}{'-':>15}{'-':>11}",
    ]
    for tier in ("local", "edge", "cloud"):
        t = f"{th[tier]:.3f}" if tier in th else "-"
        lines.append(f"{tier:<9}{acc[tier]:>10.3f}{frac[tier]:>15.3f}{t:>11}")
    lines.append(f"{'overall':<9}{acc['overall']:>10.3f}{1.0:>15.3f}{'':>11}")
    if "escalation" in result:
        e = result["escalation"]
        lines.append(f"escalation level {e['level']}: the cloud reads "
                     + ("the edge features and every present view's detail "
                        f"({e['detail_bytes_per_view']} B a view)" if e["level"] else
                        "the edge features alone"))
    if stacked := summary_line(result):
        lines.append(stacked)
    b = result["bytes_per_frame"]
    # A single camera that answers every frame itself sends nothing up.
    ratio = f"{b['raw_offload'] / b['ddnn']:.1f}x fewer" if b["ddnn"] else "nothing sent"
    lines += [
        "",
        f"uplink bytes per frame: ddnn {b['ddnn']:.1f}, raw offload {b['raw_offload']:.1f} "
        f"({ratio})",
    ]
    return "\n".join(lines)
