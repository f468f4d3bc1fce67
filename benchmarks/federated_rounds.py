"""What one Flower round costs beyond the sites' training: ``ddnn federate`` on a small
federation (the integration test's: two sites of 180 scenes, 3 cameras, 32x32, a bundle
trained one epoch) with few and with more rounds; the difference over the extra rounds is the
cost of a round, the start (processes, the run submitted) and the final evaluation cancelling
out. CPU seconds count every process (:class:`federated.Clock`), wall seconds are this
machine's. Usage::

    python -m ddnn.benchmarks.federated_rounds WORK [FEW MORE]

prints one JSON line (and writes ``WORK/federated_rounds.json``). The figures are in
docs/federated-learning.md ("What a Flower round costs").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ddnn.benchmarks.federated import Clock

LOCAL = ["--epochs", "2", "--batch-size", "32"]  # little training: the round's overhead shows


def small_federation(root: Path) -> tuple[Path, list[Path]]:
    """The starting bundle and two sites' files (made once)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    root.mkdir(parents=True, exist_ok=True)
    cfg = SceneConfig(views=3, classes=3, size=32)
    sites = [root / f"site{i}.npz" for i in range(2)]
    for i, path in enumerate(sites):
        if not path.exists():
            save_dataset(path, synthesize(180, cfg, seed=10 + i))
    start = root / "start"
    if not (start / "manifest.json").exists():
        build_bundle(sites[0], start,
                     DDNNConfig.from_flat(epochs=1, batch_size=64, seed=0, escalate="none"),
                     name="tiny", version="1.9", progress=False, log=lambda *_: None)
    return start, sites


def federate(start: Path, sites: list[Path], out: Path, rounds: int) -> dict:
    args = [sys.executable, "-m", "ddnn", "federate", "--bundle", str(start), "--out", str(out),
            "--rounds", str(rounds), *LOCAL, "--json"]
    for site in sites:
        args += ["--site", str(site)]
    with Clock() as clock:
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
    history = json.loads((out / "manifest.json").read_text())["training"]["federation"]["history"]
    return {**clock.seconds, "round_seconds": [h["seconds"] for h in history]}


def run(work: Path, few: int = 2, more: int = 6) -> dict:
    if not 1 <= few < more:
        raise ValueError(f"need 1 <= FEW < MORE rounds, got {few} and {more}")
    start, sites = small_federation(work / "small")
    runs = {n: federate(start, sites, work / f"rounds-{n}", n) for n in (few, more)}
    extra = more - few
    result = {"rounds": [few, more], "runs": {str(n): r for n, r in runs.items()},
              "per_round": {k: round((runs[more][k] - runs[few][k]) / extra, 1)
                            for k in ("wall_seconds", "cpu_seconds")}}
    (work / "federated_rounds.json").write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 3):
        print(__doc__, file=sys.stderr)
        return 2
    counts = [int(a) for a in argv[1:]] or [2, 6]
    print(json.dumps(run(Path(argv[0]), *counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
