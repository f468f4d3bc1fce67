"""Each part of the training recipe switched off, beside the defaults and the raw-offload
reference, on the benchmark's data in one run.

Every variant is trained by ``ddnn train`` on the same files with the same seed and splits, then
evaluated by ``ddnn evaluate`` on the test file (calibrated, through ONNX Runtime): the defaults
(the ``training`` benchmark's bundle), then one change undone at a time (see docs/training.md,
"Closing the gap"), then the paper's network. The yardstick is the raw-offload reference of the
``training`` benchmark (a float CNN on every raw view). One seed each: two seeds of one model
differ by 1–3 points on the generated sets, so only larger differences say anything.

    ddnn bench --only ablation [--quick]
"""

from __future__ import annotations

from pathlib import Path

from ddnn.benchmarks.common import ddnn, machine, workspace, write_json
from ddnn.benchmarks.training import reference
from ddnn.tools.evaluate import evaluate

VARIANTS = {  # name → `ddnn train` flags on top of the defaults
    "no_escalation": ["--escalate", "none"],  # the default before live escalation
    "no_distillation": ["--distill", "0"],
    "no_augmentation": ["--no-augment"],
    "narrow_device_stem": ["--device-stem", "8,8"],  # the default before float16 weights
    "paper_network": ["--paper"],
}
QUICK_VARIANTS = ("no_distillation", "paper_network")


def run(out_dir: Path, work: Path, quick: bool = False) -> dict:
    ws = workspace(work, quick=quick)
    raw = reference(ws, quick)
    rows = {"defaults": _row(evaluate(ws.bundle, ws.test))}
    for name, flags in VARIANTS.items():
        if quick and name not in QUICK_VARIANTS:
            continue
        bundle = ws.root / f"ablation-{name}"
        if not (bundle / "manifest.json").exists():
            ddnn("train", "--data", str(ws.train), "--out", str(bundle), "--no-progress",
                 "--name", "mvmc", *flags, *(["--epochs", "5"] if quick else []), quiet=True)
        rows[name] = _row(evaluate(bundle, ws.test))
    base = rows["defaults"]["overall"]
    result = {
        "machine": machine(),
        "dataset": {"train": str(ws.train), "test": str(ws.test)},
        "raw_offload_reference": raw["test_accuracy"],
        "variants": rows,
        "summary": {name: r["overall"] for name, r in rows.items()},
        "ratios": {
            **{f"{name}_minus_defaults": r["overall"] - base
               for name, r in rows.items() if name != "defaults"},
            "defaults_minus_raw_reference": base - raw["test_accuracy"],
        },
    }
    write_json(out_dir, "ablation", result)
    return result


def _row(evaluation: dict) -> dict:
    return {
        "overall": evaluation["accuracy"]["overall"],
        "cloud": evaluation["accuracy"]["cloud"],
        "local_exits": evaluation["exit_fraction"]["local"],
        "uplink_bytes_per_frame": evaluation["bytes_per_frame"]["ddnn"],
    }
