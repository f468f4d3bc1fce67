"""The paper's tables on any dataset (DDNN §IV): thresholds, device count, missing devices, filters.

All figures come from ONNX Runtime through the bundle (``BundleRuntime``), the code the tiers run:
* accuracy and local-exit fraction against the local threshold (Table II / Fig. 6);
* accuracy against the number of devices, the first k views present (Fig. 8);
* accuracy with each single device missing (Fig. 9, fault tolerance);
* accuracy and uplink bytes against the device segment's filter count (Fig. 10), by retraining.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import ddnn, pyplot, workspace, write_json
from ddnn.bundle import load_bundle
from ddnn.dataset import load_dataset
from ddnn.hierarchy import summarize
from ddnn.models.calibrate import sweep
from ddnn.runtime import BundleRuntime
from ddnn.tools.evaluate import evaluate


def _with_views(rt: BundleRuntime, ds, present: np.ndarray) -> dict:
    """Evaluate as if only ``present`` views had sent anything (others dead or missing)."""
    keep = present.any(axis=1)  # a frame with no device left gets no answer at all
    exits = rt.run_dataset(ds.X[keep], present[keep])
    y = np.where(present[keep], ds.y[keep], -1)
    out = summarize(exits, ds.label[keep], y, rt.manifest, rt.manifest.policy)
    out["answered"] = float(keep.mean())
    return out


def _plot(out_dir: Path, tables: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    t = tables["threshold"]
    ax = axes[0]
    ax.plot(t["threshold"], t["accuracy"], label="overall accuracy")
    ax.plot(t["threshold"], t["local"], label="local exit fraction")
    ax.axvline(t["calibrated"], color="grey", linestyle=":", label="calibrated")
    ax.set(
        xlabel="local threshold T", title="accuracy and local exits vs threshold", ylim=(0, 1.02)
    )
    ax.legend(fontsize=8)
    d = tables["devices"]
    ax = axes[1]
    for k in ("local", "cloud", "overall"):
        ax.plot(d["devices"], [r[k] for r in d["accuracy"]], marker="o", label=k)
    ax.set(xlabel="number of devices", ylabel="accuracy", title="accuracy vs devices")
    ax.legend(fontsize=8)
    m = tables["missing"]
    ax = axes[2]
    x = np.arange(len(m["device"]))
    ax.bar(x - 0.2, [r["local"] for r in m["accuracy"]], 0.4, label="local")
    ax.bar(x + 0.2, [r["overall"] for r in m["accuracy"]], 0.4, label="overall")
    ax.axhline(m["all_present"]["overall"], color="k", linestyle="--", label="no device missing")
    ax.set(
        xticks=x,
        xticklabels=[f"cam{i}" for i in m["device"]],
        ylabel="accuracy",
        title="one device missing",
        ylim=(0, 1.02),
    )
    ax.legend(fontsize=8, loc="lower right")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "paper_tables.png", dpi=110)
    plt.close(fig)
    if tables.get("filters"):
        f = tables["filters"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(
            f["filters"],
            [r["accuracy"]["overall"] for r in f["results"]],
            marker="o",
            label="overall accuracy",
        )
        ax.plot(
            f["filters"],
            [r["accuracy"]["device"] for r in f["results"]],
            marker="o",
            label="device accuracy",
        )
        ax2 = ax.twinx()
        ax2.plot(
            f["filters"],
            [r["bytes_per_frame"]["ddnn"] for r in f["results"]],
            "r--s",
            label="uplink bytes/frame",
        )
        ax.set(xlabel="device filters", ylabel="accuracy", title="device filter count")
        ax2.set_ylabel("bytes per frame")
        ax.legend(loc="lower left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "paper_filters.png", dpi=110)
        plt.close(fig)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    ws = workspace(work, quick=quick)
    bundle = load_bundle(ws.bundle)
    m = bundle.manifest
    ds = load_dataset(ws.test, num_classes=m.num_classes)
    rt = BundleRuntime(bundle)
    exits = rt.run_dataset(ds.X, ds.present)
    grid = np.linspace(0, 1, 51)
    s = sweep(exits, ds.label, grid, m.thresholds["edge"])
    tables: dict = {
        "threshold": {
            "threshold": grid.tolist(),
            "calibrated": m.thresholds["local"],
            **{k: v.tolist() for k, v in s.items()},
        },
    }
    devices, per_k = list(range(1, m.views + 1)), []
    for k in devices:
        mask = ds.present & (np.arange(m.views) < k)[None, :]
        per_k.append(_with_views(rt, ds, mask)["accuracy"])
    tables["devices"] = {"devices": devices, "accuracy": per_k}
    full = summarize(exits, ds.label, ds.y, m, m.policy)
    missing = []
    for i in range(m.views):
        mask = ds.present.copy()
        mask[:, i] = False
        missing.append(_with_views(rt, ds, mask)["accuracy"])
    tables["missing"] = {
        "device": list(range(m.views)),
        "accuracy": missing,
        "all_present": full["accuracy"],
    }

    filters, results = ([4, 8] if quick else [4, 8, 16]), []  # 16: the default
    for f in filters:
        path = work / f"bundle-f{f}"
        if not (path / "manifest.json").exists():
            ddnn(
                "train",
                "--data",
                str(ws.train),
                "--out",
                str(path),
                "--device-filters",
                str(f),
                "--epochs",
                "3" if quick else "20",
                "--no-progress",
                "--name",
                f"mvmc-f{f}",
            )
        results.append(evaluate(path, ws.test))
    tables["filters"] = {
        "filters": filters,
        "results": results,
        "note": "retrained per filter count with fewer epochs than the default",
    }
    _plot(out_dir, tables)
    result = {
        "dataset": str(ws.test),
        "tables": tables,
        "summary": {
            "accuracy_one_device": per_k[0]["overall"],
            "accuracy_all_devices": per_k[-1]["overall"],
            "worst_single_missing_overall": min(r["overall"] for r in missing),
        },
    }
    write_json(out_dir, "paper_tables", result)
    return result
