"""``ddnn evaluate``: run a bundle over a labelled dataset with ONNX Runtime only."""

from __future__ import annotations

from pathlib import Path

from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.errors import DatasetError
from ddnn.exits import ExitPolicy
from ddnn.hierarchy import summarize
from ddnn.runtime import BundleRuntime


def evaluate(
    bundle_dir: str | Path,
    data: str | Path,
    local_threshold: float | None = None,
    edge_threshold: float | None = None,
    threads: int | None = None,
) -> dict:
    """Evaluate the hierarchy of a bundle on a dataset file; returns the contract's JSON object."""
    bundle = load_bundle(bundle_dir)
    m = bundle.manifest
    ds = load_dataset(data, num_classes=m.num_classes)
    if ds.num_views != m.views or ds.image_shape != m.input_shape:
        raise DatasetError(
            f"{data}: has {ds.num_views} views of {ds.image_shape}, the bundle expects "
            f"{m.views} views of {m.input_shape}"
        )
    policy: ExitPolicy = m.policy.with_overrides(local=local_threshold, edge=edge_threshold)
    exits = BundleRuntime(bundle, threads=threads).run_dataset(ds.X, ds.present)
    return summarize(exits, ds.label, ds.y, m, policy)


def format_table(result: dict) -> str:
    """A readable table of an evaluation result."""
    acc, frac = result["accuracy"], result["exit_fraction"]
    th = result["thresholds"]
    lines = [
        f"samples: {result['samples']}",
        "",
        f"{'exit':<9}{'accuracy':>10}{'exit fraction':>15}{'threshold':>11}",
        f"{'device':<9}{acc['device']:>10.3f}{'-':>15}{'-':>11}",
    ]
    for tier in ("local", "edge", "cloud"):
        t = f"{th[tier]:.3f}" if tier in th else "-"
        lines.append(f"{tier:<9}{acc[tier]:>10.3f}{frac[tier]:>15.3f}{t:>11}")
    lines.append(f"{'overall':<9}{acc['overall']:>10.3f}{1.0:>15.3f}{'':>11}")
    b = result["bytes_per_frame"]
    # A single camera that answers every frame itself sends nothing up.
    ratio = f"{b['raw_offload'] / b['ddnn']:.1f}x fewer" if b["ddnn"] else "nothing sent"
    lines += [
        "",
        f"uplink bytes per frame: ddnn {b['ddnn']:.1f}, raw offload {b['raw_offload']:.1f} "
        f"({ratio})",
    ]
    return "\n".join(lines)
