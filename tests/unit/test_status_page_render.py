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
