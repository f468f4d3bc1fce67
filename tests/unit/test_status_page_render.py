"""The edge's status page escapes everything it shows (labels come from a bundle's manifest)."""

from __future__ import annotations

from ddnn.edge.status_page import render


def test_every_value_is_escaped():
    data = {"model": "m<b>", "version": "1", "healthy": False,
            "reasons": ["cloud <script>alert(1)</script> unreachable"], "answered": 1,
            "pending_frames": 0, "cloud_up": False, "degraded": 0,
            "devices": [{"device": "cam0", "view": 0, "state": "online", "late": True,
                         "last_fused_frame": 3, "last_missing": {"frame": 2, "why": "late"}}],
            "exits": {"local": {"frames": 1, "share": 1.0}, "edge": {"frames": 0, "share": 0.0},
                      "cloud": {"frames": 0, "share": 0.0}},
            "thresholds": {"local": 0.3},
            "recent": [{"frame": 3, "label": "<img src=x>", "exit": "local", "entropy": 0.1,
                        "views": ["cam0"], "missing": {}}]}
    page = render(data).decode()
    assert "<script>" not in page and "<img" not in page and "<b>" not in page
    assert "&lt;script&gt;" in page and "&lt;img src=x&gt;" in page
    assert "online (late)" in page and "2 (late)" in page and "100.0%" in page


def test_the_agreement_with_the_cloud_and_the_drift_warning_are_shown():
    data = {"model": "m", "version": "1", "healthy": True, "reasons": [],
            "warnings": ["drift: <b>86.5 %</b> agree"], "answered": 1, "pending_frames": 0,
            "cloud_up": True, "degraded": 0, "devices": [], "exits": {}, "thresholds": {},
            "recent": [],
            "drift": {"alarm": True, "budget": 0.01, "agreement": 0.995,
                      "agreement_configured": 0.865, "thresholds": {"local": 0.8, "edge": 0.1},
                      "configured": {"local": 0.99, "edge": 0.1}, "audit_rate": 0.2,
                      "investigating": False}}
    page = render(data).decode()
    assert "drift alarm" in page and "&lt;b&gt;86.5 %&lt;/b&gt; agree" in page
    assert "86.5%" in page and "99.5%" in page and "0.8" in page and "99.0%" in page
    assert "Not checked" in render({**data, "drift": None, "warnings": []}).decode()
