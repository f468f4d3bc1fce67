"""The edge's status page for an operator: ``GET /status`` (HTML) and ``GET /v1/status`` (JSON).

One look answers "is this edge well?": its health and the reasons when not, each device's state
and the last frames it was fused in (or missing from, and why), how frames leave the hierarchy
(exit shares, degraded answers), the thresholds in force, the latency objective's operating
point and the latest answers. Everything is
read from what the edge already keeps (the snapshot, the health check, the metrics, the ring of
recent results); the page refreshes itself every few seconds and needs no script.
"""

from __future__ import annotations

import html
from typing import Any

from ddnn.plumbing.health import Check
from ddnn.result import EXITS, NO_EXIT

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
    # "none": frames no view was fused in (every camera saw nothing), answered unclassified.
    counts = {tier: sum(frames.value(exit=tier, degraded=d) for d in ("false", "true"))
              for tier in (*EXITS, NO_EXIT)}
    total = sum(counts.values())
    degraded = sum(frames.value(exit=tier, degraded="true") for tier in EXITS)
    return {
        "model": m.name, "version": m.version, "healthy": check.ok, "reasons": check.reasons,
        "warnings": check.details.get("warnings", []),
        "answered": snap.answered, "pending_frames": snap.pending, "cloud_up": snap.cloud_up,
        "devices": devices,
        "exits": {tier: {"frames": int(n), "share": (n / total if total else None)}
                  for tier, n in counts.items()},
        "degraded": int(degraded),
        "thresholds": dict(snap.thresholds),
        "drift": snap.drift,
        "latency": snap.latency,
        "recent": recent[-SHOWN_RESULTS:][::-1],
    }


def _cell(value: Any) -> str:
    return "<td>" + html.escape("—" if value is None else str(value)) + "</td>"


def _row(*values: Any) -> str:
    return "<tr>" + "".join(_cell(v) for v in values) + "</tr>"


def _drift(drift: dict[str, Any] | None) -> str:
    """The exits checked against the cloud (``--audit-rate``), or a line saying they are not."""
    if drift is None:
        return "<p id='drift'>Not checked against the cloud (--audit-rate 0).</p>"

    def share(x: Any) -> str:
        return "—" if x is None else f"{x:.1%}"

    alarm = "<span class='bad'>drift alarm</span>" if drift["alarm"] else "no drift alarm"
    rows = _row("in force", share(drift["agreement"]), drift["thresholds"]["local"],
                drift["thresholds"]["edge"]) + _row(
        "configured", share(drift["agreement_configured"]), drift["configured"]["local"],
        drift["configured"]["edge"])
    return (f"<p id='drift'>{alarm}; agreement with the cloud must stay at least "
            f"{share(1 - drift['budget'])}; audit rate {drift['audit_rate']:g}"
            f"{' (investigating a shift)' if drift['investigating'] else ''}.</p>"
            "<table id='agreement'><tr><th>thresholds</th><th>agreement with the cloud</th>"
            f"<th>local</th><th>edge</th></tr>{rows}</table>")


def _latency(latency: dict[str, Any] | None) -> str:
    """The latency planner's section: its objective, point and percentiles."""
    if latency is None:
        return "<p id='latency'>No latency objective (--latency-slo).</p>"
    p = latency["point"]
    met = ("<span class='ok'>met</span>" if latency["met"] else
           "<span class='bad'>cannot be met</span>")
    rows = _row(p["level"], p["thresholds"]["local"], p["thresholds"]["edge"],
                f"{p['accuracy']:.1%}", latency["predicted_ms"], latency["measured_ms"])
    return (f"<p id='latency'>Objective {latency['objective_ms']:g} ms at "
            f"p{latency['percentile']:g}: {met}; {latency['replans']} re-plans, pull deadline "
            f"{latency['pull_deadline_ms']} ms.</p><table id='plan'><tr><th>level</th>"
            "<th>local threshold</th><th>edge threshold</th><th>held-out accuracy</th>"
            f"<th>predicted ms</th><th>measured ms</th></tr>{rows}</table>")


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
    if data.get("warnings"):
        health += "<ul id='warnings' class='bad'>" + "".join(
            f"<li>{html.escape(w)}</li>" for w in data["warnings"]) + "</ul>"
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
<h2>Agreement with the cloud</h2>
{_drift(data.get("drift"))}
<h2>Latency objective</h2>
{_latency(data.get("latency"))}
<h2>Latest answers</h2>
<table id="recent"><tr><th>frame</th><th>label</th><th>exit</th><th>entropy</th><th>views</th>
<th>missing</th></tr>{recent}</table>
</body></html>
"""
    return page.encode()
