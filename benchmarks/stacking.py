"""Stacked exits on and off, on the same trained weights (docs/training.md, "Stacked exits").

For each bundle of the tiers benchmark (``--work``/tiers, trained by ``ddnn bench --only
tiers``): two copies of it, one whose upper exits answer on their own and one whose exits stack
(``ddnn.stacking``), each given its stacking and thresholds by the very code ``ddnn train``
runs after the export (:func:`ddnn.models.build.fit_held_out`) on the bundle's own held-out
splits, and evaluated by ``ddnn evaluate --json`` on the test file. Only the stacking differs,
so the rows say what it buys: each exit's accuracy on every frame, the calibrated overall
accuracy and the uplink bytes.

    ddnn bench --only stacking [--quick]
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from ddnn.benchmarks.common import machine, write_json
from ddnn.benchmarks.tiers import (
    QUICK,
    SEEDS,
    SETS,
    VARIANTS,
    _data,
    _evaluate,
    _point,
    _train,
)
from ddnn.bundle import load_bundle

MODES = ("unstacked", "stacked")


def restack(bundle: Path, data: Path, out: Path, stacked: bool) -> Path:
    """A copy of ``bundle`` at ``out`` whose stacking (none unless ``stacked``) and thresholds
    are fitted again on its held-out splits of ``data``, as ``ddnn train`` fits them."""
    from ddnn.models.build import fit_held_out, split_data
    from ddnn.models.export import write_manifest
    from ddnn.models.federated.weights import config_of

    trained = load_bundle(bundle)
    m = trained.manifest
    cfg = config_of(trained).replace(stack_exits=stacked)
    _, _, stop_ds, val_ds = split_data(data, None, cfg)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(bundle, out)
    write_manifest(out, dataclasses.replace(m, thresholds={"local": 0.0, "edge": 0.0},
                                            escalation_level=0, stacking=None))
    held = fit_held_out(out, val_ds, stop_ds, cfg)
    cal = held.calibration
    write_manifest(out, dataclasses.replace(
        m, thresholds=cal.point.thresholds, escalation_level=cal.level, stacking=held.stacking,
        calibration={**m.calibration, **cal.to_dict()}))
    return out


def _row(bundle: Path, test: Path) -> dict:
    """``ddnn evaluate --json`` of the bundle on the test file: its point, every exit and the
    stacking it answered with."""
    e = _evaluate(bundle, test)
    return {**_point(e), "exits": {k: e["accuracy"][k] for k in ("local", "edge", "cloud")},
            "stacking": e["stacking"]}


def _mean(rows: list[dict], *keys: str) -> float:
    values = []
    for r in rows:
        for k in keys:
            r = r[k]
        values.append(r)
    return sum(values) / len(values)


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    root = work / ("tiers-quick" if quick else "tiers")
    root.mkdir(parents=True, exist_ok=True)
    sets, seeds = (QUICK["sets"], QUICK["seeds"]) if quick else (tuple(SETS), SEEDS)
    variants = ("escalate_view", "pi_device", "deep_device")
    table: dict = {}
    for name in sets:
        train, test = _data(root, name, quick)
        table[name] = {}
        for variant in variants:
            rows: dict[str, dict] = {mode: {} for mode in MODES}
            for seed in seeds:
                bundle = root / f"{name}-s{seed}-{variant}"
                _train(bundle, train, VARIANTS[variant], seed, quick)
                for mode in MODES:
                    copy = restack(bundle, train, root / "stacking" / f"{bundle.name}-{mode}",
                                   stacked=mode == "stacked")
                    rows[mode][seed] = _row(copy, test)
            table[name][variant] = {
                mode: {"seeds": r, "mean": {
                    "overall": _mean(list(r.values()), "overall"),
                    **{k: _mean(list(r.values()), "exits", k) for k in ("local", "edge", "cloud")},
                    "bytes_per_frame": _mean(list(r.values()), "bytes_per_frame")}}
                for mode, r in rows.items()}
    result = {
        "machine": machine(),
        "sets": {n: SETS[n][0] for n in sets},
        "seeds": list(seeds),
        "table": table,
        "summary": {f"{n}.{v}.{mode}": {k: round(t[v][mode]["mean"][k], 4)
                                        for k in ("local", "edge", "cloud", "overall")}
                    for n, t in table.items() for v in variants for mode in MODES},
    }
    write_json(out_dir, "stacking", result)
    return result
