"""Upper tiers that earn their place: the hierarchy against the raw-offload reference trained in
the same run, on every generated set, over two training seeds (docs/training.md, "A cloud worth
calling").

Sets, made by ``ddnn data synth`` (1500 training and 1000 test samples, 6 views of 32x32): **A**
3 classes, **B** 10 classes, **P** 10 classes with partial views (``--zoom 2``: each camera sees
part of the object). For each set and seed: the reference (``ddnn train --baseline``) and each
variant (the tiny device with escalation off and on, the tiny device taught by that
reference: ``--teacher``, ``ddnn train``'s default device, the ``pi`` preset, and the deeper
device of ``--deep-device``),
all evaluated by ``ddnn evaluate --json`` on the test file. The aims, per set:
the cloud exit at least the edge exit at least the local exit (each on every frame); the
calibrated overall accuracy at least the reference's minus 0.3 points (mean of the seeds); at
least 20x fewer device uplink bytes than raw 8-bit offload.

    ddnn bench --only tiers [--quick]

Trained bundles are cached under ``--work``/tiers, so an interrupted run resumes; the full run
trains 3 sets x 2 seeds x (reference + variants) models (hours on 2 cores). On a machine with a
GPU or many cores, train them all at once first, then let the benchmark evaluate them:

    python -m ddnn.benchmarks.tiers --work runs/bench --jobs 24
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from ddnn.benchmarks.common import ddnn, machine, write_json

SETS = {  # name → (`ddnn data synth` flags, train seed, test seed)
    "A": (["--classes", "3"], 1, 2),
    "B": (["--classes", "10"], 11, 12),
    "P": (["--classes", "10", "--zoom", "2"], 31, 32),
}
SEEDS = (0, 1)
TINY = ["--preset", "tiny"]  # the microcontroller-sized device, the default before the pi preset
VARIANTS = {  # name → `ddnn train` flags, each naming its preset;
    # {reference}: the path of the same set and seed's reference bundle
    "no_escalation": [*TINY, "--escalate", "none"],
    "escalate_view": [*TINY, "--escalate", "view"],
    "teacher": [*TINY, "--escalate", "view", "--teacher", "{reference}"],
    # `ddnn train`'s default, the pi preset: stem blocks of 16 and 48 filters, no escalation
    "pi": ["--preset", "pi", "--threads", "1"],
    # the deep preset (the default before pi), no escalation; one thread, as its rows in
    # docs/benchmarks/tiers.json were trained (thread counts change the arithmetic)
    "deep_device": ["--deep-device", "--threads", "1"],
    # between the two: double-conv stem blocks of 16 and 32 filters, 32 binary features a cell
    # (a 61 KB device of 27 k weights, 0.088 ms a frame), escalation on (docs/training.md,
    # "A device between"); one thread, as its rows were trained
    "pi_device": [*TINY, "--device-stem", "16,32", "--device-convs", "2", "--device-filters",
                  "32", "--threads", "1"],
}
TRAIN, TEST = 1500, 1000
QUICK = {"sets": ("A",), "seeds": (0,), "train": 300, "test": 200, "epochs": "3"}


def _data(root: Path, name: str, quick: bool) -> tuple[Path, Path]:
    flags, train_seed, test_seed = SETS[name]
    n_train, n_test = (QUICK["train"], QUICK["test"]) if quick else (TRAIN, TEST)
    paths = root / f"{name}-train.npz", root / f"{name}-test.npz"
    for path, n, seed in zip(paths, (n_train, n_test), (train_seed, test_seed), strict=True):
        if not path.exists():
            ddnn("data", "synth", "--out", str(path), "--samples", str(n), "--seed", str(seed),
                 *flags)
    return paths


def _train(out: Path, train: Path, flags: list[str], seed: int, quick: bool) -> float | None:
    """Train unless cached; the wall time of `ddnn train`, None when reused."""
    if (out / "manifest.json").exists():
        return None
    start = time.perf_counter()
    ddnn("train", "--data", str(train), "--out", str(out), "--name", "bench", "--seed",
         str(seed), "--no-progress", *flags, *(["--epochs", QUICK["epochs"]] if quick else []),
         quiet=True)
    return time.perf_counter() - start


def _bundles(root: Path, name: str, seed: int) -> tuple[Path, dict[str, tuple[Path, list[str]]]]:
    """The reference's path, and each variant's path and `ddnn train` flags."""
    reference = root / f"{name}-s{seed}-reference"
    return reference, {v: (root / f"{name}-s{seed}-{v}",
                           [f.format(reference=reference) for f in flags])
                       for v, flags in VARIANTS.items()}


def train_all(work: Path, quick: bool = False, jobs: int = 2) -> None:
    """Train every bundle the benchmark needs, ``jobs`` at a time (a variant that learns from
    its reference after the references), so that :func:`run` then only evaluates. For a
    machine with many cores or a GPU; the trainings' wall times are not recorded."""
    from concurrent.futures import ThreadPoolExecutor

    root = work / ("tiers-quick" if quick else "tiers")
    root.mkdir(parents=True, exist_ok=True)
    sets, seeds = (QUICK["sets"], QUICK["seeds"]) if quick else (tuple(SETS), SEEDS)
    data = {name: _data(root, name, quick) for name in sets}
    first, taught = [], []
    one = ["--threads", "1"]  # many trainings at once: one CPU thread each
    for name in sets:
        for seed in seeds:
            reference, variants = _bundles(root, name, seed)
            first.append((reference, data[name][0], ["--baseline", *one], seed))
            for v, (out, flags) in variants.items():
                wave = taught if "{reference}" in " ".join(VARIANTS[v]) else first
                wave.append((out, data[name][0], [*flags, *one], seed))
    with ThreadPoolExecutor(jobs) as pool:
        for wave in (first, taught):
            list(pool.map(lambda job: _train(*job, quick), wave))


def _evaluate(bundle: Path, test: Path, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "ddnn", "evaluate", "--bundle", str(bundle),
                           "--data", str(test), "--json", *flags], check=True,
                          capture_output=True, text=True)
    return json.loads(proc.stdout)


def _point(e: dict) -> dict:
    acc, b = e["accuracy"], e["bytes_per_frame"]
    return {
        "overall": acc["overall"],
        "exit_fraction": e["exit_fraction"],
        "escalation_level": e.get("escalation", {}).get("level", 0),
        "bytes_per_frame": b["ddnn"],
        "x_fewer_than_raw": b["raw_offload"] / b["ddnn"] if b["ddnn"] else None,
    }


def _row(bundle: Path, test: Path, seconds: float | None) -> dict:
    """The calibrated bundle on the test file, its exits, and the point its held-out curve
    gives for a budget of raw offload / 20 (``ddnn evaluate --max-bytes``)."""
    e = _evaluate(bundle, test)
    budget = e["bytes_per_frame"]["raw_offload"] / 20
    return {
        **_point(e),
        "exits": {k: e["accuracy"][k] for k in ("device", "local", "edge", "cloud")},
        "cloud_by_level": e.get("escalation", {}).get("cloud_accuracy"),
        "within_raw_over_20": _point(_evaluate(bundle, test, "--max-bytes", f"{budget:.2f}")),
        "train_seconds": seconds,
    }


def _aims(rows: dict[str, dict], reference: float) -> dict:
    ordered = all(r["exits"]["cloud"] >= r["exits"]["edge"] >= r["exits"]["local"]
                  for r in rows.values())
    overall = sum(r["overall"] for r in rows.values()) / len(rows)
    fewer = min(r["x_fewer_than_raw"] or float("inf") for r in rows.values())
    return {"cloud_ge_edge_ge_local": ordered, "overall_mean": overall,
            "overall_minus_reference": overall - reference,
            "within_0.3pt_of_reference": overall >= reference - 0.003,
            "x_fewer_min": fewer, "at_least_20x_fewer_bytes": fewer >= 20}


def _gate(rows: dict[int, dict], refs: dict[int, dict]) -> dict:
    """Issue 41's accuracy gate for a variant: the mean over the seeds at least the reference's,
    no seed more than 0.5 points under the reference of its seed, 50x fewer bytes than raw."""
    behind = {s: r["overall"] - refs[s]["overall"] for s, r in rows.items()}
    mean = sum(behind.values()) / len(behind)
    fewer = min(r["x_fewer_than_raw"] or float("inf") for r in rows.values())
    return {"mean_minus_reference": mean, "worst_seed_minus_reference": min(behind.values()),
            "met": mean >= 0 and min(behind.values()) >= -0.005 and fewer >= 50}


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    root = work / ("tiers-quick" if quick else "tiers")
    root.mkdir(parents=True, exist_ok=True)
    sets, seeds = (QUICK["sets"], QUICK["seeds"]) if quick else (tuple(SETS), SEEDS)
    table: dict = {}
    for name in sets:
        train, test = _data(root, name, quick)
        refs, variants = {}, {v: {} for v in VARIANTS}
        for seed in seeds:
            out, planned = _bundles(root, name, seed)
            seconds = _train(out, train, ["--baseline"], seed, quick)
            refs[seed] = {"overall": _evaluate(out, test)["accuracy"]["overall"],
                          "train_seconds": seconds}
            for variant, (out, flags) in planned.items():
                seconds = _train(out, train, flags, seed, quick)
                variants[variant][seed] = _row(out, test, seconds)
        reference = sum(r["overall"] for r in refs.values()) / len(refs)
        table[name] = {
            "reference": {"seeds": refs, "overall_mean": reference},
            "variants": {v: {"seeds": rows, "aims": _aims(rows, reference),
                             "gate": _gate(rows, refs)} for v, rows in variants.items()},
        }
    result = {
        "machine": machine(),
        "sets": {n: SETS[n][0] for n in sets},
        "seeds": list(seeds),
        "table": table,
        "summary": {f"{n}.{v}": round(t["variants"][v]["aims"]["overall_minus_reference"], 4)
                    for n, t in table.items() for v in VARIANTS},
        "aims": {f"{n}.{v}": all(t["variants"][v]["aims"][k] for k in
                                 ("cloud_ge_edge_ge_local", "within_0.3pt_of_reference",
                                  "at_least_20x_fewer_bytes"))
                 for n, t in table.items() for v in VARIANTS},
        "gate": {f"{n}.{v}": t["variants"][v]["gate"]["met"]
                 for n, t in table.items() for v in VARIANTS},
    }
    write_json(out_dir, "tiers", result)
    return result


if __name__ == "__main__":  # python -m ddnn.benchmarks.tiers --work W [--quick] [--jobs N]
    import argparse

    p = argparse.ArgumentParser(description="train the tiers benchmark's bundles in parallel; "
                                "`ddnn bench --only tiers --work W` then evaluates them")
    p.add_argument("--work", default="runs/bench", help="as `ddnn bench --work`")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--jobs", type=int, default=2, help="trainings at a time")
    a = p.parse_args()
    train_all(Path(a.work), a.quick, a.jobs)
