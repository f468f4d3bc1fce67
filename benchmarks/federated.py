"""Learning in the field: a bundle trained on one domain, taken to three sites whose cameras
were re-mounted, turned and lit differently (``ddnn data synth --drift all``), each holding a
non-IID share of the classes (``--sites 3 --non-iid``).

Side by side on one held-out field set (``ddnn evaluate``): the bundle as it came (before),
``ddnn federate`` with FedAvg and with dynamic averaging (DMA), and ``ddnn train`` on all the
sites' data pooled in one place (central, what federation avoids). Rounds, communicated bytes
and wall time of each, per-round held-out accuracy plotted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import ddnn, machine, pyplot, workspace, write_json
from ddnn.tools.evaluate import evaluate

SITES, ALPHA = 3, 1.0
SITE_SAMPLES, FIELD_SAMPLES = 1500, 600  # all sites together; the held-out field set
# Both strategies run as `ddnn federate` runs them bare (FederationSettings' defaults).


def _field_data(root: Path, quick: bool) -> tuple[list[Path], Path, Path]:
    """The sites' files, the field test set and the pooled file for central training."""
    root.mkdir(parents=True, exist_ok=True)
    n = SITE_SAMPLES // 3 if quick else SITE_SAMPLES
    sites = [root / f"site-{i}.npz" for i in range(SITES)]
    if not all(p.exists() for p in sites):
        ddnn("data", "synth", "--out", str(root / "site.npz"), "--samples", str(n), "--seed",
             "21", "--drift", "all", "--sites", str(SITES), "--non-iid", str(ALPHA))
    test = root / "field-test.npz"
    if not test.exists():
        ddnn("data", "synth", "--out", str(test), "--samples",
             str(FIELD_SAMPLES // 3 if quick else FIELD_SAMPLES), "--seed", "22", "--drift", "all")
    pooled = root / "pooled.npz"
    if not pooled.exists():
        from ddnn.models.synth import save_dataset

        parts = [dict(np.load(p)) for p in sites]
        save_dataset(pooled, {k: (np.concatenate([p[k] for p in parts]) if k != "classes"
                                  else parts[0][k]) for k in parts[0]})
    return sites, test, pooled


def _federate(bundle: Path, sites: list[Path], out: Path, strategy: str, quick: bool) -> dict:
    args = [sys.executable, "-m", "ddnn", "federate", "--bundle", str(bundle), "--out", str(out),
            "--strategy", strategy, "--json", *(["--rounds", "3"] if quick else [])]
    for s in sites:
        args += ["--site", str(s)]
    start = time.perf_counter()
    done = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_seconds"] = round(time.perf_counter() - start, 1)
    return result


def _central(pooled: Path, out: Path, quick: bool) -> float:
    start = time.perf_counter()
    args = ["train", "--data", str(pooled), "--out", str(out), "--name", "mvmc", "--no-progress"]
    ddnn(*args, *(["--epochs", "5"] if quick else []))
    return round(time.perf_counter() - start, 1)


def _plot(out_dir: Path, runs: dict, before: float, central: float) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in runs.items():
        hist = r["history"]
        a.plot([h["round"] for h in hist], [h["holdout_accuracy"] for h in hist], marker="o",
               label=f"{name} (held-out, start of round)")
        b.plot([h["round"] for h in hist], [h["communicated_bytes"] / 1e6 for h in hist],
               marker="o", label=name)
    a.axhline(before, color="grey", linestyle=":", label="before (field test)")
    a.axhline(central, color="black", linestyle="--", label="central (field test)")
    a.set_xlabel("round")
    a.set_ylabel("cloud-exit accuracy")
    a.legend(fontsize=7)
    b.set_xlabel("round")
    b.set_ylabel("model arrays sent, MB (both ways)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "federated.png", dpi=120)
    plt.close(fig)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    ws = workspace(work, quick=quick)  # the bundle trained on the original domain
    root = work / "federated"
    sites, test, pooled = _field_data(root, quick)
    before = evaluate(ws.bundle, test)
    central_seconds = _central(pooled, root / "central", quick)
    central = evaluate(root / "central", test)
    runs, results = {}, {}
    for strategy in ("fedavg", "dma"):
        r = _federate(ws.bundle, sites, root / strategy, strategy, quick)
        fed = json.loads((root / strategy / "manifest.json").read_text())["training"]
        runs[strategy] = fed["federation"]
        results[strategy] = {"evaluation": evaluate(root / strategy, test), "rounds": r["rounds"],
                             "communicated_bytes": r["communicated_bytes"],
                             "wall_seconds": r["wall_seconds"], "version": r["version"],
                             "syncs": [h["sync"] for h in fed["federation"]["history"]]}
    acc = {"before": before["accuracy"]["overall"], "central": central["accuracy"]["overall"],
           **{k: v["evaluation"]["accuracy"]["overall"] for k, v in results.items()}}
    fed_bytes, dma_bytes = (results[k]["communicated_bytes"] for k in ("fedavg", "dma"))
    evals = [("before", before), ("central", central),
             *((k, v["evaluation"]) for k, v in results.items())]
    summary = {
        "machine": machine(),
        "setup": {"sites": SITES, "non_iid_alpha": ALPHA, "site_samples": SITE_SAMPLES,
                  "field_samples": FIELD_SAMPLES, "quick": quick,
                  "federate": {k: v for k, v in runs["dma"].items() if k != "history"}},
        "summary": {
            "accuracy_overall": acc,
            "communicated_mb": {k: v["communicated_bytes"] / 1e6 for k, v in results.items()},
            # Each version's calibrated point: the escalation level (the sites' tables cover
            # level 1 too) and the uplink payload bytes a frame on the field set.
            "escalation_level": {k: e.get("escalation", {}).get("level") for k, e in evals},
            "bytes_per_frame": {k: e["bytes_per_frame"]["ddnn"] for k, e in evals},
            "seconds": {"central": central_seconds,
                        **{k: v["wall_seconds"] for k, v in results.items()}},
        },
        "accuracy": acc,
        "before": before, "central": central, "central_seconds": central_seconds,
        "federated": results,
        "ratios": {"dma_bytes_over_fedavg": dma_bytes / fed_bytes,
                   "fedavg_minus_central": acc["fedavg"] - acc["central"],
                   "fedavg_minus_before": acc["fedavg"] - acc["before"],
                   "dma_minus_fedavg": acc["dma"] - acc["fedavg"]},
        "aims": {
            "fedavg_within_2pt_of_central": acc["fedavg"] >= acc["central"] - 0.02,
            "fedavg_30pt_above_before": acc["fedavg"] >= acc["before"] + 0.30,
            "dma_within_1pt_of_fedavg": acc["dma"] >= acc["fedavg"] - 0.01,
            "dma_half_the_bytes": dma_bytes <= fed_bytes / 2,
            "each_run_within_15_min": max(r["wall_seconds"] for r in results.values()) <= 900
            and central_seconds <= 900,
        },
    }
    _plot(out_dir, runs, before["accuracy"]["cloud"], central["accuracy"]["cloud"])
    write_json(out_dir, "federated", summary)
    return summary
