"""The training report beside a bundle: metrics JSON and plots against the thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ddnn.bundle import Manifest
from ddnn.hierarchy import UplinkCost, raw_offload_bytes
from ddnn.models.calibrate import sweep


def threshold_curves(
    exits: dict[str, np.ndarray],
    labels: np.ndarray,
    present: np.ndarray,
    manifest: Manifest,
    points: int = 101,
) -> dict[str, list[float]]:
    """Accuracy, exit fractions and uplink bytes per frame against the local threshold."""
    grid = np.linspace(0.0, 1.0, points)
    level = manifest.escalation_level
    s = sweep(exits, labels, grid, manifest.thresholds.get("edge", 0.0), level)
    cost = UplinkCost.of(manifest)
    n_present = present.sum(1)
    detail = cost.details(exits, n_present).mean() if level else 0.0  # a frame's, escalated
    bytes_pf = (n_present.mean() * (cost.sent_scores + (1.0 - s["local"]) * cost.features)
                + s["cloud"] * detail)
    return {
        "threshold": grid.tolist(),
        "accuracy": s["accuracy"].tolist(),
        "local_fraction": s["local"].tolist(),
        "edge_fraction": s["edge"].tolist(),
        "cloud_fraction": s["cloud"].tolist(),
        "bytes_per_frame": bytes_pf.tolist(),
        "raw_offload_bytes": float(raw_offload_bytes(present.sum(1), manifest.input_shape).mean()),
    }


def write_config(out: Path, cfg) -> Path:
    """``config.toml`` in the report folder ``out``: the configuration the bundle was trained
    with, as ``ddnn train --config`` reads it back (cfg: a ``DDNNConfig``)."""
    from ddnn.models.config_file import to_toml

    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.toml"
    path.write_text(to_toml(cfg, "the configuration this bundle was trained with: "
                                 "ddnn train --config config.toml trains it again"))
    return path


def write_report(
    out: Path, metrics: dict, curves: dict[str, list[float]], manifest: Manifest
) -> list[Path]:
    """Write ``metrics.json`` and PNG plots into ``out``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    files = [out / "metrics.json"]
    files[0].write_text(json.dumps({**metrics, "curves": curves}, indent=2) + "\n")
    t = np.asarray(curves["threshold"])
    t_local = manifest.thresholds.get("local", 0.0)
    title = f"{manifest.name}:{manifest.version} ({manifest.scheme}, {manifest.views} views)"

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(t, curves["accuracy"], label="overall accuracy")
    ax.plot(t, curves["local_fraction"], label="local exit fraction")
    ax.plot(t, curves["edge_fraction"], label="edge exit fraction", linestyle="--")
    ax.axvline(t_local, color="grey", linestyle=":", label=f"calibrated T_local = {t_local:.3f}")
    ax.set(
        xlabel="local exit threshold T (normalized entropy)",
        ylabel="fraction",
        ylim=(0, 1.02),
        title=title,
    )
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    files.append(out / "accuracy_vs_threshold.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(t, curves["bytes_per_frame"], label="ddnn device uplink")
    ax.axhline(
        curves["raw_offload_bytes"],
        color="tab:red",
        linestyle="--",
        label="raw offload (8-bit images)",
    )
    ax.axvline(t_local, color="grey", linestyle=":", label=f"calibrated T_local = {t_local:.3f}")
    ax.set(
        xlabel="local exit threshold T (normalized entropy)",
        ylabel="bytes per frame",
        yscale="log",
        title=title,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    files.append(out / "bytes_vs_threshold.png")
    fig.tight_layout()
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    curve = metrics.get("calibration", {}).get("curve")
    if curve:
        files.append(_operating_curve(plt, out, curve, metrics["calibration"],
                                      curves["raw_offload_bytes"], title))
    return files


def _operating_curve(plt, out: Path, curve: dict, calibration: dict, raw: float,
                     title: str) -> Path:
    """Held-out accuracy against uplink bytes per frame, one line per escalation level, with
    the point calibration picked."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    level = np.asarray(curve["level"])
    x, y = np.asarray(curve["bytes_per_frame"]), np.asarray(curve["accuracy"])
    # The bytes frontier only (the curve also holds the latency planner's points, cheapest
    # first): the points more accurate than every cheaper one.
    keep = y > np.maximum.accumulate(np.concatenate([[-np.inf], y[:-1]]))
    level, x, y = level[keep], x[keep], y[keep]
    names = {0: "edge features to the cloud", 1: "+ the devices' detail (escalation)"}
    for lv in sorted(set(level.tolist())):
        ax.plot(x[level == lv], y[level == lv], marker=".", linestyle="-", label=names[lv])
    ax.plot([calibration["bytes_per_frame"]], [calibration["accuracy"]], "k*", markersize=12,
            label="calibrated")
    ax.axvline(raw / 20, color="tab:red", linestyle=":", label="raw offload / 20")
    ax.set(xlabel="device uplink bytes per frame (held-out)", ylabel="overall accuracy",
           xscale="log", title=title)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, which="both")
    path = out / "operating_curve.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
