"""``ddnn bench``: run the benchmark suite and write JSON and plots into ``docs/benchmarks``."""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

# name → (module, how to call its run()). Each writes <name>.json (and plots) into the output.
BENCHMARKS = {
    "training": "ddnn.benchmarks.training",
    "ablation": "ddnn.benchmarks.ablation",  # each training change off, beside the reference
    "tiers": "ddnn.benchmarks.tiers",  # every set x 2 seeds: variants against the reference
    "stacking": "ddnn.benchmarks.stacking",  # the tiers' bundles with stacked exits on and off
    "paper_tables": "ddnn.benchmarks.paper_tables",
    "device_footprint": "ddnn.benchmarks.device_footprint",
    "cloud_throughput": "ddnn.benchmarks.cloud_throughput",
    "edge_cloud_bytes": "ddnn.benchmarks.edge_cloud_bytes",  # FP32 vs packed features, bytes
    "hierarchy_latency": "ddnn.benchmarks.hierarchy_latency",
    "alignment": "ddnn.benchmarks.alignment",  # skewed starts under load: fixed vs adaptive
    "edge_ingest": "ddnn.benchmarks.edge_ingest",
    "livez_under_load": "ddnn.benchmarks.livez_under_load",  # /livez, 80 clients never reading
    "raw_vs_hierarchy": "ddnn.benchmarks.raw_vs_hierarchy",
    "bandwidth": "ddnn.benchmarks.bandwidth",
    "soak": "ddnn.benchmarks.soak",  # minutes of the full hierarchy: memory and every frame
    "federated": "ddnn.benchmarks.federated",  # drifted sites: before, FedAvg, DMA, central
    "drift": "ddnn.benchmarks.drift",  # live domain change: fixed vs adaptive exit thresholds
    "latency_slo": "ddnn.benchmarks.latency_slo",  # a cloud slowing mid-run: fixed vs planner
    "closed_loop": "ddnn.benchmarks.closed_loop",  # drift, labels, federation, over the air
}


OWN_PACKAGES = {"ddnn"}


def register(sub, data_sub, formatter) -> None:
    p = sub.add_parser(
        "bench",
        help="run the benchmark suite (results and plots into docs/benchmarks)",
        description="Run the benchmarks, each beside its baseline in the same run, and write "
        "JSON and PNG plots. The default generated dataset and bundle are made once under "
        "--work and reused.",
        formatter_class=formatter,
    )
    p.add_argument(
        "--only",
        nargs="+",
        choices=sorted(BENCHMARKS),
        metavar="NAME",
        help=f"run only these: {', '.join(BENCHMARKS)}",
    )
    p.add_argument("--out", default="docs/benchmarks", help="where results and plots go")
    p.add_argument("--work", default="runs/bench", help="datasets and bundles (cached)")
    p.add_argument("--quick", action="store_true", help="small data and short runs (smoke test)")
    p.set_defaults(func=_bench)


def _call(name: str, out: Path, work: Path, quick: bool) -> dict:
    module = importlib.import_module(BENCHMARKS[name])
    if name in ("training", "ablation", "paper_tables", "federated", "drift", "tiers",
                "stacking", "latency_slo", "closed_loop"):
        return module.run(out, work, quick=quick)
    from ddnn.benchmarks.common import workspace

    ws = workspace(work, quick=quick)
    if name == "cloud_throughput":
        return module.run(out, ws.bundle, quick=quick)
    if name == "raw_vs_hierarchy":
        from ddnn.benchmarks.common import reference_bundle

        return module.run(out, ws.bundle, ws.test, quick=quick,
                          reference=reference_bundle(ws, quick))
    if name == "soak":
        return module.run(out, ws.bundle, ws.test, quick=quick, logs_dir=work / "soak")
    return module.run(out, ws.bundle, ws.test, quick=quick)


def _bundle_facts(bundle: Path) -> dict | None:
    """Which default bundle the run used: name, version, when made, escalation, training."""
    try:
        m = json.loads((bundle / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    t = m.get("training", {})
    return {
        "path": str(bundle),
        "model": f"{m['model']['name']}:{m['model']['version']}",
        "created": m.get("created"),
        "escalation": m.get("escalation"),  # absent: a bundle without live escalation
        "training": {k: t.get(k) for k in ("preset", "samples", "epochs", "device", "precision")
                     if k in t},
    }


def _stamp(out: Path, work: Path, name: str, quick: bool, seconds: float) -> dict | None:
    """Add a ``run`` block to ``<name>.json``: when and where it ran, how long, which bundle,
    and the command that reproduces it (the report shows these beside the figures)."""
    from datetime import UTC, datetime

    from ddnn.benchmarks.common import machine

    path = out / f"{name}.json"
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    result["run"] = {
        "finished_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"),
        "wall_seconds": round(seconds, 1),
        "command": f"ddnn bench --only {name}" + (" --quick" if quick else ""),
        "quick": quick,
        "machine": result.get("machine") or machine(),
        "default_bundle": _bundle_facts(work / "bundle"),
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
    return result


def _last_time(out: Path, name: str) -> str:
    """How long this benchmark took last time, from its JSON's run block: what to expect."""
    try:
        seconds = json.loads((out / f"{name}.json").read_text())["run"]["wall_seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f"; it took {seconds / 60:.1f} min last time"


def _bench(args) -> int:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)  # the summary is written even if every run fails
    names = args.only or list(BENCHMARKS)
    failed: list[str] = []
    skipped: list[str] = []
    began = time.perf_counter()
    for i, name in enumerate(names, 1):
        elapsed = time.perf_counter() - began
        print(f"== [{i}/{len(names)}] {name} ({elapsed / 60:.1f} min so far"
              f"{_last_time(out, name)})", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            result = _call(name, out, work, args.quick)
        except ModuleNotFoundError as e:
            # Only a missing optional dependency (matplotlib, an extra) is a skip; a missing
            # module of our own is a bug and fails like any other.
            if (e.name or "").split(".")[0] not in OWN_PACKAGES:
                print(f"   skipped: {e}", file=sys.stderr)
                skipped.append(name)
                continue
            print(f"   failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        except Exception as e:  # one broken benchmark must not hide the others' results
            print(f"   failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        took = time.perf_counter() - start
        result = _stamp(out, work, name, args.quick, took) or result
        brief = {k: v for k, v in result.items() if k in ("ratios", "aims", "skipped", "summary")}
        print(f"   done in {took:.0f} s: {json.dumps(brief)[:400]}", file=sys.stderr)
    from ddnn.benchmarks.report import write_readme

    total = time.perf_counter() - began
    ran = len(names) - len(failed) - len(skipped)
    print(f"{ran} of {len(names)} benchmarks ran in {total / 60:.1f} min"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped: {', '.join(skipped)}" if skipped else ""), file=sys.stderr)
    print(f"results in {out}/, summary in {write_readme(out)}", file=sys.stderr)
    return 1 if failed else 0
