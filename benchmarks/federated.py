"""Learning in the field under real non-IID drift: a bundle trained on a home domain of ten
classes seen in part (``--classes 10 --zoom 2``), taken to three sites whose cameras were
re-mounted, turned and lit differently (``--drift all``), each holding a few hundred labelled
frames with its own class mix (a Dirichlet label split, ``--sites 3 --non-iid 0.3``).

Side by side on one held-out field set (``ddnn evaluate``), for each of two seeds: the bundle as
it came (before), ``ddnn federate`` with its defaults (FedAvg), with SCAFFOLD's variates
derived (``--scaffold-variates derived``) and with dynamic averaging (DMA), and ``ddnn
train`` on all the sites' data pooled in one place (central, the reference federation aims
at). Rounds, communicated bytes and wall time of each; per-round held-out
accuracy plotted against rounds and against bytes, beside central.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ddnn.benchmarks.common import ddnn, machine, pyplot, write_json
from ddnn.tools.evaluate import evaluate

# The scene: ten classes, each camera twice as close (it sees part of the object).
CLASSES, ZOOM = 10, 2
SITES, ALPHA = 3, 0.3  # Dirichlet concentration of each class over the sites (<= 0.5: skewed)
HOME_SAMPLES, HOME_EPOCHS = 2000, 20  # the home domain the starting bundle is trained on
SITE_SAMPLES, FIELD_SAMPLES = 1500, 1000  # all sites together; the held-out field set
# Each seed draws its own sites and field set; `ddnn train` and `ddnn federate` run with their
# default seeds, as a user runs them.
SEEDS = (1, 2)
# An explicit preset: the figures must not move when `ddnn train`'s default does.
PRESET = "tiny"
# Each as `ddnn federate` runs it: its name, the strategy and any flags (none: its defaults).
# fedavg-derived is FedAvg with SCAFFOLD's variates derived, not sent (option II: the models
# alone travel).
RUNS = {"fedavg": ("fedavg",), "fedavg-derived": ("fedavg", "--scaffold-variates", "derived"),
        "dma": ("dma",)}


def _synth(out: Path, samples: int, seed: int, *extra: str) -> None:
    ddnn("data", "synth", "--out", str(out), "--samples", str(samples), "--seed", str(seed),
         "--classes", str(CLASSES), "--zoom", str(ZOOM), *extra)


def _home_bundle(root: Path, quick: bool) -> Path:
    """The starting bundle: ``ddnn train`` on the home domain (no drift), cached."""
    root.mkdir(parents=True, exist_ok=True)
    data, bundle = root / "home.npz", root / "home"
    if not data.exists():
        _synth(data, HOME_SAMPLES // 4 if quick else HOME_SAMPLES, 1)
    if not (bundle / "manifest.json").exists():
        ddnn("train", "--data", str(data), "--out", str(bundle), "--name", "mvmc", "--preset",
             PRESET, "--epochs", str(3 if quick else HOME_EPOCHS), "--no-progress")
    return bundle


def field_data(root: Path, seed: int, quick: bool) -> tuple[list[Path], Path, Path]:
    """One seed's sites, its held-out field set and the sites' data pooled for central."""
    root.mkdir(parents=True, exist_ok=True)
    sites = [root / f"site-{i}.npz" for i in range(SITES)]
    if not all(p.exists() for p in sites):
        _synth(root / "site.npz", SITE_SAMPLES // 3 if quick else SITE_SAMPLES, 20 + seed,
               "--drift", "all", "--sites", str(SITES), "--non-iid", str(ALPHA))
    test = root / "field-test.npz"
    if not test.exists():
        _synth(test, FIELD_SAMPLES // 4 if quick else FIELD_SAMPLES, 30 + seed, "--drift", "all")
    pooled = root / "pooled.npz"
    if not pooled.exists():
        from ddnn.models.synth import save_dataset

        parts = [dict(np.load(p)) for p in sites]
        save_dataset(pooled, {k: (np.concatenate([p[k] for p in parts]) if k != "classes"
                                  else parts[0][k]) for k in parts[0]})
    return sites, test, pooled


def federate(bundle: Path, sites: list[Path], out: Path, strategy: str, quick: bool,
             *options: str) -> dict:
    """``ddnn federate`` as a user runs it, its ``--json`` result and its wall time."""
    args = [sys.executable, "-m", "ddnn", "federate", "--bundle", str(bundle), "--out", str(out),
            "--strategy", strategy, "--json",
            *(["--rounds", "3"] if quick else []), *options]
    for s in sites:
        args += ["--site", str(s)]
    with Clock() as clock:
        done = subprocess.run(args, check=True, stdout=subprocess.PIPE, text=True)
    return {**json.loads(done.stdout.strip().splitlines()[-1]), **clock.seconds}


def _central(pooled: Path, out: Path, quick: bool) -> dict:
    with Clock() as clock:
        ddnn("train", "--data", str(pooled), "--out", str(out), "--name", "mvmc", "--preset",
             PRESET, "--no-progress", *(["--epochs", "5"] if quick else []))
    return clock.seconds


class Clock:
    """Wall time and the CPU time of every process run meanwhile: on a shared machine the CPU
    seconds (over the cores it has) say what the run takes on an idle one.

    Flower's processes outlive their parents (the SuperNode's SuperExec, which reaps the
    ClientApps, is stopped with it but never waited for), so this process becomes the child
    subreaper (Linux): orphans are re-parented to it and reaped here, and their CPU time, the
    sites' training included, is counted. Without that only the processes' own parents'
    waits count, and the sites' work goes missing."""

    def __enter__(self) -> Clock:
        _subreaper()
        self._wall, self._cpu = time.perf_counter(), self._children()
        return self

    def __exit__(self, *exc) -> None:
        _reap_orphans()
        self.seconds = {"wall_seconds": round(time.perf_counter() - self._wall, 1),
                        "cpu_seconds": round(self._children() - self._cpu, 1)}

    @staticmethod
    def _children() -> float:
        use = resource.getrusage(resource.RUSAGE_CHILDREN)
        return use.ru_utime + use.ru_stime


def _subreaper() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def _reap_orphans(grace: float = 30.0) -> None:
    """Wait for the orphans re-parented here (stopped with their process group, they exit
    within moments); after ``grace`` seconds one still running is left alone."""
    deadline = time.monotonic() + grace
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return  # no child left
        if pid == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def run_seed(bundle: Path, root: Path, seed: int, quick: bool) -> dict:
    """Before, central and every strategy on one seed's field."""
    sites, test, pooled = field_data(root, seed, quick)
    central_time = _central(pooled, root / "central", quick)
    evals = {"before": evaluate(bundle, test), "central": evaluate(root / "central", test)}
    runs = {}
    for name, (strategy, *flags) in RUNS.items():
        r = federate(bundle, sites, root / name, strategy, quick, *flags)
        fed = json.loads((root / name / "manifest.json").read_text())["training"]
        evals[name] = evaluate(root / name, test)
        runs[name] = {"rounds": r["rounds"], "communicated_bytes": r["communicated_bytes"],
                          "wall_seconds": r["wall_seconds"], "cpu_seconds": r["cpu_seconds"],
                          "version": r["version"],
                          "syncs": [h["sync"] for h in fed["federation"]["history"]],
                          "history": fed["federation"]["history"]}
    acc = {k: e["accuracy"]["overall"] for k, e in evals.items()}
    return {"seed": seed, "accuracy": acc,
            "cloud_accuracy": {k: e["accuracy"]["cloud"] for k, e in evals.items()},
            "local_exits": {k: e["exit_fraction"]["local"] for k, e in evals.items()},
            "bytes_per_frame": {k: e["bytes_per_frame"]["ddnn"] for k, e in evals.items()},
            "escalation_level": {k: e.get("escalation", {}).get("level")
                                 for k, e in evals.items()},
            "seconds": {"central": central_time["wall_seconds"],
                        **{k: r["wall_seconds"] for k, r in runs.items()}},
            "cpu_seconds": {"central": central_time["cpu_seconds"],
                            **{k: r["cpu_seconds"] for k, r in runs.items()}},
            "communicated_bytes": {k: r["communicated_bytes"] for k, r in runs.items()},
            "federated": runs}


def aims(seeds: list[dict]) -> dict:
    """The issue's aims, each checked on every seed."""
    def every(test) -> bool:
        return all(test(s["accuracy"], s["communicated_bytes"]) for s in seeds)

    return {
        # An honest benchmark: central training does not saturate, and today's FedAvg shows
        # the gap (at least 3 points under central) on both seeds.
        "central_under_0.97": every(lambda a, b: a["central"] < 0.97),
        "benchmark_shows_a_gap_of_3pt": every(lambda a, b: a["fedavg"] <= a["central"] - 0.03),
        "fedavg_within_2pt_of_central": every(lambda a, b: a["fedavg"] >= a["central"] - 0.02),
        "dma_within_1pt_of_fedavg": every(lambda a, b: a["dma"] >= a["fedavg"] - 0.01),
        "dma_half_the_bytes": every(lambda a, b: b["dma"] <= b["fedavg"] / 2),
        "derived_variates_within_1pt_of_fedavg": every(
            lambda a, b: a["fedavg-derived"] >= a["fedavg"] - 0.01),
        # On the 2-core reference machine: wall time where it was idle, else CPU time / 2.
        "each_run_within_15_min": all(max(s["seconds"].values()) <= 900 for s in seeds),
        "each_run_within_15_min_of_2_cores": all(max(s["cpu_seconds"].values()) <= 2 * 900
                                                 for s in seeds),
    }


def plot(path: Path, seeds: list[dict]) -> None:
    """Held-out accuracy of each round's starting model against rounds and against the bytes
    communicated so far, one line per strategy and seed, central's field accuracy beside."""
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    colours = {"fedavg": "tab:blue", "fedavg-derived": "tab:green", "dma": "tab:orange"}
    for s, style in zip(seeds, ("-", "--"), strict=False):
        for name, r in s["federated"].items():
            hist = r["history"]
            acc = [h["holdout_accuracy"] for h in hist]
            label = f"{name}, seed {s['seed']}"
            a.plot([h["round"] for h in hist], acc, style, marker="o", color=colours.get(name),
                   label=label)
            b.plot([h["communicated_bytes"] / 1e6 for h in hist], acc, style, marker="o",
                   color=colours.get(name), label=label)
        for ax in (a, b):
            ax.axhline(s["cloud_accuracy"]["central"], color="black", linestyle=style,
                       linewidth=1, label=f"central, seed {s['seed']} (field test)")
    a.set_xlabel("round")
    a.set_ylabel("cloud-exit accuracy (sites' held-out splits)")
    b.set_xlabel("communicated so far, MB (both ways, all sites)")
    a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    root = work / "federated-noniid"
    bundle = _home_bundle(root, quick)
    seeds = [run_seed(bundle, root / f"seed-{s}", s, quick) for s in SEEDS]
    names = ("before", "central", *RUNS)
    summary = {
        "machine": machine(),
        "setup": {"classes": CLASSES, "zoom": ZOOM, "sites": SITES, "non_iid_alpha": ALPHA,
                  "home_samples": HOME_SAMPLES, "home_epochs": HOME_EPOCHS,
                  "site_samples": SITE_SAMPLES, "field_samples": FIELD_SAMPLES,
                  "seeds": list(SEEDS), "preset": PRESET, "quick": quick},
        "summary": {
            "accuracy_overall": {k: [s["accuracy"][k] for s in seeds] for k in names},
            "communicated_mb": {k: [s["communicated_bytes"][k] / 1e6 for s in seeds]
                                for k in RUNS},
            "derived_bytes_over_fedavg": [s["communicated_bytes"]["fedavg-derived"]
                                          / s["communicated_bytes"]["fedavg"] for s in seeds],
            "derived_minus_fedavg": [s["accuracy"]["fedavg-derived"] - s["accuracy"]["fedavg"]
                                     for s in seeds],
            "dma_bytes_over_fedavg": [s["communicated_bytes"]["dma"]
                                      / s["communicated_bytes"]["fedavg"] for s in seeds],
            "fedavg_minus_central": [s["accuracy"]["fedavg"] - s["accuracy"]["central"]
                                     for s in seeds],
            "dma_minus_fedavg": [s["accuracy"]["dma"] - s["accuracy"]["fedavg"] for s in seeds],
        },
        "aims": aims(seeds),
        "seeds": seeds,
    }
    plot(out_dir / "federated.png", seeds)
    write_json(out_dir, "federated", summary)
    return summary
