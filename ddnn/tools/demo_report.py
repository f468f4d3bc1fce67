"""What ``ddnn demo`` reports: the live run beside the offline evaluation, the checks the demo
proves itself by, the table it prints and the report it writes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def offline_answers(classes: np.ndarray, tiers: np.ndarray, view_labels: np.ndarray
                     ) -> dict[int, tuple[str, int | None]]:
    """Each frame's answer as ``ddnn evaluate`` computes it: (exit, class); a frame no camera
    saw is answered ("none", None), as the edge answers it."""
    names = ("local", "edge", "cloud")
    seen = (view_labels >= 0).any(axis=1)
    return {f: (names[int(tiers[f])], int(classes[f])) if seen[f] else ("none", None)
            for f in range(len(tiers))}


def summary(results: dict[int, dict], ds, offline: dict, payload: float | None, m,
             expected: dict[int, tuple[str, int | None]] | None = None) -> dict:
    """The live run beside the offline one; with ``expected`` (each frame's offline answer)
    the checks the demo proves itself by."""
    n = ds.num_samples
    tiers = ("local", "edge", "cloud")
    answered = [results[f] for f in sorted(results) if f < n]
    # A frame no camera saw is answered with exit "none" and no class: not in the accuracy.
    def right(r: dict) -> bool:
        return r["class"] == int(ds.label[r["frame"]])

    correct = [right(r) for r in answered if r["exit"] != "none"]
    lat = {t: [r["latency_ms"] for r in answered if r["exit"] == t] for t in tiers}
    raw = offline["bytes_per_frame"]["raw_offload"]
    exits = {t: sum(r["exit"] == t for r in answered) for t in tiers}
    # Frames whose live answer is not the offline one (a degraded frame lost a view: counted).
    differ = sorted(r["frame"] for r in answered if expected is not None
                    and (r["exit"], r["class"]) != expected[r["frame"]])
    checks = {"every_frame_answered": len(answered) == n,
              "live_equals_offline": expected is not None and not differ,
              "every_tier_answers": all(exits[t] > 0 for t in tiers)}
    return {
        "frames": n,
        "answered": len(answered),
        "degraded": sum(bool(r.get("degraded")) for r in answered),
        "exits": exits,
        "checks": checks,
        "differ_from_offline": differ[:20],  # the first of them, to look up in results.jsonl
        "differ_count": len(differ),
        "no_view": sum(r["exit"] == "none" for r in answered),
        "live_accuracy": float(np.mean(correct)) if correct else 0.0,
        # Each tier's accuracy on the frames it answered (None: it answered none).
        "accuracy_by_exit": {t: _mean([right(r) for r in answered if r["exit"] == t])
                             for t in tiers},
        "offline": offline,
        "bytes_per_frame": {
            "live": payload / n if payload is not None else None,
            "offline": offline["bytes_per_frame"]["ddnn"],
            "raw_offload": raw,
        },
        "latency_ms": {
            t: (
                {
                    "p50": float(np.percentile(v, 50)),
                    "p99": float(np.percentile(v, 99)),
                    "count": len(v),
                }
                if v
                else None
            )
            for t, v in lat.items()
        },
        "model": f"{m.name}:{m.version}",
    }


def _mean(values: list[bool]) -> float | None:
    return float(np.mean(values)) if values else None


def table(s: dict) -> str:
    off = s["offline"]
    lines = [
        f"DDNN demo — {s['model']}, {s['frames']} frames, {s['answered']} answered, "
        f"{s['degraded']} degraded",
        "",
        f"{'exit':<8}{'frames':>8}{'live share':>12}{'offline share':>15}{'accuracy':>10}"
        f"{'p50 ms':>9}{'p99 ms':>9}",
    ]
    for t in ("local", "edge", "cloud"):
        lat = s["latency_ms"][t]
        p50, p99 = (f"{lat['p50']:.1f}", f"{lat['p99']:.1f}") if lat else ("-", "-")
        share = s["exits"][t] / max(s["answered"], 1)
        acc = s["accuracy_by_exit"][t]
        lines.append(
            f"{t:<8}{s['exits'][t]:>8}{share:>12.3f}{off['exit_fraction'][t]:>15.3f}"
            f"{'-' if acc is None else f'{acc:.3f}':>10}{p50:>9}{p99:>9}"
        )
    if s.get("no_view"):
        lines.append(f"{'none':<8}{s['no_view']:>8}   frames no camera saw (answered, "
                     "unclassified)")
    b = s["bytes_per_frame"]
    live_b = f"{b['live']:.1f}" if b["live"] is not None else "n/a"
    lines += [
        "",
        f"accuracy: live hierarchy {s['live_accuracy']:.3f}   offline evaluation "
        f"{off['accuracy']['overall']:.3f}   (cloud exit alone {off['accuracy']['cloud']:.3f})",
        f"uplink bytes per frame: live {live_b}   offline {b['offline']:.1f}   raw offload "
        f"{b['raw_offload']:.1f}   ({b['raw_offload'] / max(b['offline'], 1e-9):.0f}x fewer)",
    ]
    if checks := s.get("checks"):
        lines.append("checks: " + ", ".join(
            f"{name.replace('_', ' ')} {'ok' if ok else 'FAILED'}" for name, ok in checks.items())
            + (f" ({s['differ_count']} frames differ from offline)" if s["differ_count"] else ""))
    if stages := s.get("stages"):  # CPU seconds: the machine may be shared
        lines.append("stages, CPU s (wall s): " + ", ".join(
            f"{name} {t['cpu_s']:.1f} ({t['wall_s']:.1f})" for name, t in stages.items()))
    from ddnn.stacking import summary_line

    if stacked := summary_line(off):  # why an upper tier answers as it does (or passes up)
        lines.append(stacked)
    return "\n".join(lines)


def write_report(out: Path, s: dict, results: dict[int, dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    tiers = ("local", "edge", "cloud")
    colours = {"local": "tab:green", "edge": "tab:orange", "cloud": "tab:blue"}
    axes[0].bar(tiers, [s["exits"][t] for t in tiers], color=[colours[t] for t in tiers])
    axes[0].set(title="frames per exit tier", ylabel="frames")
    for t in tiers:
        v = [r["latency_ms"] for r in results.values() if r["exit"] == t]
        if v:
            axes[1].hist(v, bins=30, alpha=0.6, label=t, color=colours[t])
    axes[1].set(title="end-to-end latency", xlabel="ms", ylabel="frames")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(out / "demo.png", dpi=110)
    plt.close(fig)
    md = out / "report.md"
    md.write_text(
        f"# DDNN demo report\n\n```\n{table(s)}\n```\n\n![exits and latency](demo.png)\n"
    )
    return md
