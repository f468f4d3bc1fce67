"""A tuning study for the federated benchmark: which change to the round loop pays, before any
is spent on Flower runs.

The round loop of ``ddnn federate`` without Flower, calibration or export: each site runs
:func:`trainer.fit` from the shared weights, the server averages the replies by their example
counts (:func:`strategy.weighted_average`), optionally with server momentum (FedAvgM) or with
SCAFFOLD's control variates (each site's steps corrected by the sites' mean gradient of the last
round less its own; Karimireddy et al., 2020; ``ddnn federate --scaffold``). It starts
from the federated benchmark's home bundle on one seed's sites and scores every exit on a
*tuning* field set of its own (never the benchmark's ``field-test.npz``). Usage::

    python -m ddnn.benchmarks.federated_sweep SEED_DIR HOME TUNING.npz NAME [rounds=30 ...]

with the options ``rounds``, ``epochs``, ``lr``, ``proximal``, ``momentum``, ``seed``,
``balance``, ``batch``, ``scaffold`` (SCAFFOLD's control variates, scaled) and ``derived``
(1: SCAFFOLD's option II, the variates derived from the models, :mod:`scaffold`); one JSON line
per run is printed and appended to ``SEED_DIR/../sweep.jsonl``.
The figures are in docs/federated-learning.md ("Where the gap comes from").
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

OPTIONS = {"rounds": 10, "epochs": 2.0, "lr": 2e-3, "proximal": 0.0, "momentum": 0.0, "seed": 0,
           "balance": 0.0, "batch": 64,
           "scaffold": 0, "derived": 0}


def sweep(seed_dir: Path, home: Path, tuning: Path, **options: float) -> dict:
    """One variant of the round loop; the tuning set's accuracy at each exit after the last
    round, and the CPU seconds the sites' training took."""
    import torch

    from ddnn.bundle import load_bundle
    from ddnn.dataset import load_dataset
    from ddnn.models.calibrate import fit_stacking
    from ddnn.models.federated import scaffold
    from ddnn.models.federated.strategy import weighted_average
    from ddnn.models.federated.trainer import LocalTraining, fit, load_site, round_lr
    from ddnn.models.federated.weights import (
        architecture,
        build_model,
        model_from_bundle,
        model_weights,
        set_weights,
        trainable_names,
    )
    from ddnn.models.train import predict

    o = {**OPTIONS, **options}
    if o["derived"] and not o["scaffold"]:
        raise ValueError("derived=1 derives SCAFFOLD's variates: give scaffold=1 (its scale)")
    rounds, seed = int(o["rounds"]), int(o["seed"])
    arch = architecture(load_bundle(home))
    weights = model_weights(model_from_bundle(home))
    sites = [load_site(arch, p, holdout=0.2, seed=seed)
             for p in sorted(seed_dir.glob("site-*.npz"))]
    torch.set_num_threads(1)
    velocity = None
    params = set(trainable_names(arch))
    controls = [{n: np.zeros_like(weights[n]) for n in params} for _ in sites]  # SCAFFOLD's c_i
    corrections: list[dict | None] = [None for _ in sites]  # option II's, from the last round
    start = time.process_time()
    for r in range(1, rounds + 1):
        local = LocalTraining(epochs=o["epochs"], lr=round_lr(o["lr"], r, rounds), seed=seed,
                              proximal=o["proximal"], balance=o["balance"],
                              batch_size=int(o["batch"]))
        if o["derived"]:  # option II: the corrections of the last round's models
            replies = [fit(arch, weights, site, local, r, step_correction=c)
                       for site, c in zip(sites, corrections, strict=True)]
        else:
            shared = (weighted_average(controls, [s.examples for s in sites])
                      if o["scaffold"] else None)
            replies = [fit(arch, weights, site, local, r, correction=None if shared is None
                           else {n: float(o["scaffold"]) * (shared[n] - c[n]) for n in params})
                       for site, c in zip(sites, controls, strict=True)]
            if shared is not None:
                controls = [x.gradient for x in replies]
        average = weighted_average([x.weights for x in replies], [x.examples for x in replies])
        if o["derived"]:  # the next round's corrections, read off the models
            own = [scaffold.own_direction(weights, x.weights, x.steps * local.lr, c, params)
                   for x, c in zip(replies, corrections, strict=True)]
            span = local.lr * scaffold.round_span([x.steps for x in replies],
                                                  [x.examples for x in replies])
            shared = scaffold.shared_direction(weights, average, span, params)
            corrections = [{n: float(o["scaffold"]) * v for n, v in
                            scaffold.step_correction(shared, d).items()} for d in own]
        if o["momentum"]:  # FedAvgM: the server's step keeps a share of the last one
            step = {k: average[k] - weights[k] for k in weights}
            velocity = step if velocity is None else {
                k: o["momentum"] * velocity[k] + step[k] for k in weights}
            average = {k: (weights[k] + velocity[k]).astype(weights[k].dtype) for k in weights}
        weights = average
    seconds = time.process_time() - start
    model = build_model(arch)
    set_weights(model, weights)
    data = load_dataset(tuning, num_classes=len(arch["classes"]))
    logits = predict(model, data)
    tiers = ("local", "edge", "cloud", "escalated")
    exits = {k: v for k, v in logits.items() if k in tiers}
    held = [predict(model, site.holdout) for site in sites]
    # The stacking ``ddnn federate`` refits: fit on the union of the sites' held-out splits.
    refit = fit_stacking({k: np.concatenate([h[k] for h in held]) for k in exits},
                         np.concatenate([site.holdout.label for site in sites]), arch["views"])
    stacked = refit.apply(exits)
    return {"options": o, "cpu_seconds": round(seconds, 1),
            "accuracy": {k: float(np.mean(v.argmax(-1) == data.label)) for k, v in exits.items()},
            "stacking": refit.to_dict(),
            "stacked": {k: float(np.mean(stacked[k].argmax(-1) == data.label)) for k in exits}}


def main(argv: list[str]) -> int:
    if len(argv) < 4:
        print(__doc__, file=sys.stderr)
        return 2
    seed_dir, home, tuning, name = Path(argv[0]), Path(argv[1]), Path(argv[2]), argv[3]
    options = {}
    for item in argv[4:]:
        key, _, value = item.partition("=")
        if key not in OPTIONS:
            print(f"unknown option {key!r}: choose from {', '.join(OPTIONS)}", file=sys.stderr)
            return 2
        options[key] = float(value)
    result = {"name": name, "seed_dir": str(seed_dir), **sweep(seed_dir, home, tuning, **options)}
    line = json.dumps(result)
    print(line, flush=True)
    with open(seed_dir.parent / "sweep.jsonl", "a") as f:
        f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
