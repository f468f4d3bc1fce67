"""Write ``README.md`` beside the benchmark results: every figure with the command behind it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

INTRO = """# Benchmark results

Written by `ddnn bench` from the JSON files in this folder; every benchmark runs its baseline in
the same run on the same machine, so compare ratios and medians, not absolute numbers across
machines. The machine these were taken on has 2 cores and no GPU, and was shared with other work
while they ran: treat single figures as noisy. Reproduce one with `ddnn bench --only NAME`
(`--quick` for a smoke run); the default generated dataset and bundle are cached in `runs/bench`.

Which bundle: `training`, `ablation`, `paper_tables`, `device_footprint` and `raw_vs_hierarchy`
were last run with today's defaults (1500 training samples); the others were last run with the
paper preset's bundle (`ddnn train --paper`, 3000 training samples, 57% local exits), the
defaults before docs/training.md's "Closing the gap", and have not been re-run since.
"""


def _flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    rows: list[tuple[str, object]] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            rows += _flatten(v, f"{key}.")
        elif not isinstance(v, list):
            rows.append((key, v))
    return rows


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _section(name: str, result: dict, out_dir: Path) -> str:
    try:
        doc = (importlib.import_module(f"ddnn.benchmarks.{name}").__doc__ or "").strip()
    except ImportError:
        doc = ""
    lines = [f"## {name}", "", doc, "", f"Reproduce: `ddnn bench --only {name}`", ""]
    if "skipped" in result:
        return "\n".join([*lines, f"Skipped: {result['skipped']}", ""])
    shown = {k: result[k] for k in ("summary", "ratios", "aims") if k in result}
    if name == "training":
        shown = {"evaluation": result["evaluation"], "train_seconds": result["train_seconds"],
                 **shown}
    if name == "device_footprint":
        shown = result
    rows = _flatten(shown)
    if rows:
        lines += ["| figure | value |", "|---|---|"]
        lines += [f"| {k} | {_fmt(v)} |" for k, v in rows]
        lines.append("")
    for png in sorted(out_dir.glob(f"{name}*.png")):
        lines += [f"![{png.stem}]({png.name})", ""]
    lines += [f"Full results: [{name}.json]({name}.json)", ""]
    return "\n".join(lines)


def write_readme(out_dir: Path) -> Path:
    """Summarize every ``*.json`` result in ``out_dir`` into ``out_dir/README.md``."""
    parts = [INTRO]
    for path in sorted(out_dir.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        parts.append(_section(path.stem, result, out_dir))
    readme = out_dir / "README.md"
    readme.write_text("\n".join(parts))
    return readme
