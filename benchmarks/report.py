"""Write ``README.md`` beside the benchmark results: per benchmark the question it answers, one
table of its figures beside the same run's baseline, its plots, how to reproduce it, and when,
where and on which bundle it ran.

What each table shows is data (a :class:`Spec` in :mod:`ddnn.benchmarks.report_specs`): JSON
paths for rows and columns, so the report follows the JSON and never goes stale by hand.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Col:
    """One column. ``path`` is a ``/``-separated path from the JSON root in which ``{0}``,
    ``{1}`` stand for the row's keys (a segment may be a glob: ``baseline_*``). With ``base``,
    the cell compares the figure with the baseline: ``how`` is ``ratio`` (figure / baseline),
    ``fewer`` (baseline / figure) or ``diff`` (figure - baseline, in the column's scale)."""

    header: str  # with its unit: "p50 (ms)"
    path: str
    base: str | None = None
    how: str = "value"
    scale: float = 1.0  # 100 shows a fraction as %; 1000 shows seconds as ms


@dataclass(frozen=True)
class Row:
    """An explicit row: its label, the keys its columns' ``{0}``, ``{1}`` take, and optionally
    its own scale and comparison (tables whose rows are different figures)."""

    label: str
    keys: tuple[str, ...]
    scale: float | None = None
    how: str | None = None


@dataclass(frozen=True)
class Spec:
    """How one benchmark is reported."""

    question: str  # one sentence: what the benchmark answers
    baseline: str  # what the baseline column is, measured in the same run
    cols: tuple[Col, ...]
    rows: str | tuple[Row, ...]  # a pattern such as "per_tier/*" (its keys), or explicit rows
    label: str = ""  # the header of the row labels
    setup: tuple[str, ...] = ()  # scalar paths shown above the table ("frames", "fps")
    bundle: str = ("the default bundle (`runs/bench/bundle`, trained by the first benchmark "
                   "that needs it with `ddnn train`'s defaults)")
    plots: tuple[str, ...] = field(default=())  # PNG names; default: every ``<name>*.png``


MISSING = "–"


def lookup(result: object, path: str) -> object:
    """The value at ``path`` (``/``-separated; a segment may be a glob over a dict's keys or a
    list index), or None."""
    node = result
    for part in path.split("/"):
        if isinstance(node, dict):
            if part not in node and any(c in part for c in "*?["):
                part = next((k for k in node if fnmatch.fnmatch(k, part)), part)
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def expand(result: dict, pattern: str) -> list[tuple[str, ...]]:
    """The key tuples a row pattern matches: ``rates/*/*`` → ``[("1mbit", "raw_8bit"), …]``."""
    found: list[tuple[tuple[str, ...], object]] = [((), result)]
    for part in pattern.split("/"):
        nxt = []
        for keys, node in found:
            if part == "*":
                items = (node.items() if isinstance(node, dict)
                         else enumerate(node) if isinstance(node, list) else ())
                nxt += [((*keys, str(k)), v) for k, v in items]
            elif isinstance(node, dict) and part in node:
                nxt.append((keys, node[part]))
        found = nxt
    return [keys for keys, _ in found]


def number(v: float) -> str:
    """A figure to about three significant digits, thousands separated."""
    if isinstance(v, int) or (v.is_integer() and 100 <= abs(v) < 1e12):
        return f"{int(v):,}"
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 0.01 or a == 0:
        return f"{v:.3g}"
    return f"{v:.2g}"


def cell(result: dict, col: Col, row: Row) -> str:
    value = lookup(result, col.path.format(*row.keys))
    how = row.how if (row.how and col.how != "value") else col.how
    scale = row.scale if row.scale is not None else col.scale
    if how == "value":
        return _plain(value, scale)
    base = lookup(result, (col.base or "").format(*row.keys)) if col.base else None
    if not isinstance(value, int | float) or not isinstance(base, int | float):
        return MISSING
    if how == "diff":
        return f"{(value - base) * scale:+.1f} pt" if scale == 100 else f"{value - base:+.3g}"
    if how == "fewer":
        if not value:
            return MISSING
        return f"{base / value:.3g}× fewer" if base >= value else f"{value / base:.3g}× more"
    return f"{value / base:.3g}×" if base else MISSING


def _plain(value: object, scale: float) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return number(value * scale)
    if value is None or isinstance(value, dict | list):
        return MISSING
    return str(value)


def table(result: dict, spec: Spec) -> list[str]:
    """The benchmark's one table, in Markdown."""
    rows = spec.rows if isinstance(spec.rows, tuple) else tuple(
        Row(" · ".join(keys), keys) for keys in expand(result, spec.rows))
    lines = ["| " + " | ".join([spec.label, *(c.header for c in spec.cols)]) + " |",
             "|" + "---|" * (len(spec.cols) + 1)]
    for row in rows:
        cells = [cell(result, c, row) for c in spec.cols]
        lines.append("| " + " | ".join([row.label, *cells]) + " |")
    return lines


def provenance(name: str, result: dict, spec: Spec, out_dir: Path) -> list[str]:
    """Reproduce / ran on / when / which bundle, from the ``run`` block ``ddnn bench`` adds."""
    run = result.get("run")
    lines = []
    if run:
        lines.append(f"- **Reproduce:** `{run['command']}` (`--quick` for a smoke run)")
    mach = (run or {}).get("machine") or result.get("machine")
    if mach:
        facts = [mach.get("platform"), mach.get("cpus") and f"{mach['cpus']} CPUs",
                 mach.get("python") and f"Python {mach['python']}"]
        lines.append(f"- **Machine:** {', '.join(f for f in facts if f)}")
    else:
        lines.append("- **Machine:** not recorded in its JSON (it ran before benchmarks "
                     "recorded one)")
    if run:
        lines.append(f"- **Ran:** finished {run['finished_utc']} UTC, "
                     f"{run['wall_seconds'] / 60:.1f} min wall time")
        b = run.get("default_bundle")
        if b and "default bundle" in spec.bundle:
            esc = b.get("escalation") or {}
            lines.append(f"- **Bundle:** {spec.bundle}: {b['model']}, made {b['created']}, "
                         f"live escalation level {esc.get('level', 'none')}")
        else:
            lines.append(f"- **Bundle:** {spec.bundle}")
    else:
        when = committed(out_dir / f"{name}.json")
        when = f"last committed {when}" if when else "the JSON does not say when"
        lines.append(f"- **Ran:** before `ddnn bench` stamped its results ({when}); bundle: "
                     f"{spec.bundle}")
    return lines


def committed(path: Path) -> str | None:
    """When git last committed ``path`` (UTC), for results without a ``run`` block."""
    import subprocess

    try:
        out = subprocess.run(["git", "log", "-1", "--date=format-local:%Y-%m-%d %H:%M",
                              "--format=%cd", "--", path.name], cwd=path.parent,
                             capture_output=True, text=True, timeout=10,
                             env={"TZ": "UTC", "PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{out.stdout.strip()} UTC" if out.returncode == 0 and out.stdout.strip() else None


def aims(result: dict) -> list[str]:
    """The benchmark's own aims, met or not, in one line."""
    out = []
    for name, aim in (result.get("aims") or {}).items():
        if isinstance(aim, bool):
            out.append(f"{'✓' if aim else '✗'} {name}")
        elif isinstance(aim, dict) and "met" in aim:
            got = aim.get("measured", aim.get("ratio"))
            got = f" ({number(got)} vs {number(aim['target'])})" if isinstance(
                got, int | float) and isinstance(aim.get("target"), int | float) else ""
            out.append(f"{'✓' if aim['met'] else '✗'} {name}{got}")
    return [f"Aims: {'; '.join(out)}.", ""] if out else []


def section(name: str, result: dict, spec: Spec | None, out_dir: Path) -> str:
    lines = [f"## {name}", ""]
    if spec is None:
        return "\n".join([*lines, f"No table yet: see [{name}.json]({name}.json).", ""])
    lines += [f"**Question.** {spec.question}", ""]
    if "skipped" in result:
        return "\n".join([*lines, f"Skipped: {result['skipped']}", ""])
    leaves = [p.split("/")[-1] for p in spec.setup]
    # A path's last name, unless two paths end in it ("overall"): then the whole path.
    shown = [f"{leaf if leaves.count(leaf) == 1 else p.replace('/', ' ')} "
             f"{_setup(lookup(result, p))}"
             for p, leaf in zip(spec.setup, leaves, strict=True) if lookup(result, p) is not None]
    if shown:
        lines += ["Setup: " + "; ".join(shown).rstrip(".") + ".", ""]
    lines += [*table(result, spec), "", f"Baseline: {spec.baseline}", "", *aims(result)]
    plots = spec.plots or tuple(p.name for p in sorted(out_dir.glob(f"{name}*.png")))
    shown = [f"![{Path(p).stem}]({p})" for p in plots if (out_dir / p).exists()]
    lines += [*shown, *([""] if shown else []), *provenance(name, result, spec, out_dir),
              f"- **All figures:** [{name}.json]({name}.json)", ""]
    return "\n".join(lines)


def _setup(v: object) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} = {_setup(x)}" for k, x in v.items())
    if isinstance(v, list):
        return " ".join(str(x) for x in v)
    return number(v) if isinstance(v, float) else str(v)


def index(results: dict[str, dict], specs: dict[str, Spec], estimates: dict[str, str],
          out_dir: Path) -> list[str]:
    """One line per benchmark: its question, when it ran, and its wall time (measured where
    its JSON has a ``run`` block, else the estimate); the measured total is the suite's budget
    without the estimates."""
    lines = ["| benchmark | question | ran (UTC) | wall time (min) |", "|---|---|---|---|"]
    total = 0.0
    for name, result in results.items():
        question = specs[name].question if name in specs else ""
        run = result.get("run")
        if run:
            total += run["wall_seconds"] / 60
            ran, took = run["finished_utc"], f"{run['wall_seconds'] / 60:.1f}"
        else:
            when = committed(out_dir / f"{name}.json")
            ran = f"not stamped; committed {when[:-4]}" if when else "not stamped"
            took = f"estimate: {estimates[name]}" if name in estimates else "not measured"
        lines.append(f"| [{name}](#{name}) | {question} | {ran} | {took} |")
    lines.append(f"| **measured total** | | | **{total:.0f}** |")
    return lines


def write_readme(out_dir: Path) -> Path:
    """Summarize every ``*.json`` result in ``out_dir`` into ``out_dir/README.md``."""
    from ddnn.benchmarks.report_specs import ESTIMATES, INTRO, SPECS

    results = {}
    for path in sorted(out_dir.glob("*.json")):
        try:
            results[path.stem] = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
    order = [n for n in SPECS if n in results] + [n for n in results if n not in SPECS]
    results = {n: results[n] for n in order}
    parts = [INTRO, *index(results, SPECS, ESTIMATES, out_dir), ""]
    parts += [section(n, r, SPECS.get(n), out_dir) for n, r in results.items()]
    readme = out_dir / "README.md"
    readme.write_text("\n".join(parts))
    return readme
