"""The edge's status page for an operator: ``GET /status`` (HTML) and ``GET /v1/status`` (JSON).

One look answers "is this edge well?": its health and the reasons when not, each device's state
and the last frames it was fused in (or missing from, and why), how frames leave the hierarchy
(exit shares, degraded answers), the thresholds in force and the latest answers. Everything is
read from what the edge already keeps (the snapshot, the health check, the metrics, the ring of
recent results); the page refreshes itself every few seconds and needs no script.
"""

from __future__ import annotations

import html
from typing import Any

from ddnn.plumbing.health import Check
from ddnn.result import EXITS

REFRESH_S = 2  # the page reloads itself this often
SHOWN_RESULTS = 20  # latest answers listed on the page


def status(agg, check: Check) -> dict[str, Any]:
    """The page's content as JSON-ready data (``GET /v1/status``)."""
    snap = agg.snapshot()
    m = snap.manifest
    recent = agg.recent.all()
    states = check.details.get("devices") or {}
    devices = []
    for view, device in enumerate(snap.devices):
        fused = [r["frame"] for r in recent if device in r["views"]]
        missing = [(r["frame"], r["missing"][device]) for r in recent if device in r["missing"]]
        devices.append({
            "device": device, "view": view, "state": states.get(device, "unknown"),
            "late": device in snap.late_devices,
            "last_fused_frame": fused[-1] if fused else None,
            "last_missing": ({"frame": missing[-1][0], "why": missing[-1][1]}
                             if missing else None)})
    frames = agg.metrics.frames
    counts = {tier: sum(frames.value(exit=tier, degraded=d) for d in ("false", "true"))
              for tier in EXITS}
    total = sum(counts.values())
    degraded = sum(frames.value(exit=tier, degraded="true") for tier in EXITS)
    return {
        "model": m.name, "version": m.version, "healthy": check.ok, "reasons": check.reasons,
        "answered": snap.answered, "pending_frames": snap.pending, "cloud_up": snap.cloud_up,
        "devices": devices,
        "exits": {tier: {"frames": int(n), "share": (n / total if total else None)}
                  for tier, n in counts.items()},
        "degraded": int(degraded),
        "thresholds": dict(snap.thresholds),
        "recent": recent[-SHOWN_RESULTS:][::-1],
    }


def _cell(value: Any) -> str:
    return "<td>" + html.escape("—" if value is None else str(value)) + "</td>"


def _row(*values: Any) -> str:
    return "<tr>" + "".join(_cell(v) for v in values) + "</tr>"


def render(data: dict[str, Any]) -> bytes:
    """The status page (HTML) of :func:`status`'s data; every value is escaped."""
    health = ("<p id='health' class='ok'>healthy</p>" if data["healthy"] else
              "<p id='health' class='bad'>unhealthy</p><ul id='reasons'>" +
              "".join(f"<li>{html.escape(r)}</li>" for r in data["reasons"]) + "</ul>")
    devices = "".join(_row(
        d["device"], d["view"], d["state"] + (" (late)" if d["late"] else ""),
        d["last_fused_frame"],
        None if d["last_missing"] is None else
        f"{d['last_missing']['frame']} ({d['last_missing']['why']})") for d in data["devices"])
    exits = "".join(_row(tier, e["frames"], "—" if e["share"] is None else f"{e['share']:.1%}",
                         data["thresholds"].get(tier))
                    for tier, e in data["exits"].items())
    recent = "".join(_row(r["frame"], r["label"], r["exit"], r["entropy"], ", ".join(r["views"]),
                          ", ".join(f"{k}: {v}" for k, v in r["missing"].items()) or None)
                     for r in data["recent"])
    title = html.escape(f"ddnn edge: {data['model']} {data['version']}")
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="{REFRESH_S}">
<title>{title}</title>
<style>body{{font-family:sans-serif;margin:1.5em}}table{{border-collapse:collapse;margin-bottom:1em}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}.ok{{color:#070}}.bad{{color:#b00}}
</style></head><body>
<h1>{title}</h1>
{health}
<p>{data['answered']} frames answered, {data['pending_frames']} being assembled, cloud
{'up' if data['cloud_up'] else 'down'}, {data['degraded']} answers degraded.</p>
<h2>Devices</h2>
<table id="devices"><tr><th>device</th><th>view</th><th>state</th><th>last frame fused</th>
<th>last frame missing</th></tr>{devices}</table>
<h2>Exits</h2>
<table id="exits"><tr><th>exit</th><th>frames</th><th>share</th><th>threshold</th></tr>
{exits}</table>
<h2>Latest answers</h2>
<table id="recent"><tr><th>frame</th><th>label</th><th>exit</th><th>entropy</th><th>views</th>
<th>missing</th></tr>{recent}</table>
</body></html>
"""
    return page.encode()
