"""The benchmark report: one table per benchmark from JSON paths, the same run's baseline beside
each figure, the plots, the command, the machine and when it ran (ddnn.benchmarks.report)."""

from __future__ import annotations

import json

from ddnn.benchmarks.report import Col, Row, Spec, cell, expand, lookup, section, write_readme
from ddnn.benchmarks.report_specs import SPECS

RESULT = {
    "per_tier": {"local": {"p50_ms": 8.0, "floor_ms": 4.0, "frames": 120},
                 "cloud": {"p50_ms": 20.0, "floor_ms": 5.0, "frames": 9}},
    "acc": {"ddnn": 0.989, "raw": 0.947},
    "memory": {"baseline_727b469": {"mib": 60.0}, "this_tree": {"mib": 15.0}},
    "paced": {"0.5": {"p50": 3.0}},
    "aims": {"p50_within_2x": {"target": 2.0, "measured": 2.0, "met": True}, "fast": False},
    "machine": {"python": "3.11.7", "cpus": 2, "platform": "Linux-x86_64"},
    "run": {"finished_utc": "2026-11-25 23:40", "wall_seconds": 90.0,
            "command": "ddnn bench --only latency", "quick": False,
            "default_bundle": {"model": "mvmc:1", "created": "2026-11-25T23:20:00Z",
                               "escalation": {"level": 2, "views": 6}}},
}
LATENCY = Spec(
    question="How long per exit?", baseline="the floor.", label="exit", rows="per_tier/*",
    cols=(Col("frames", "per_tier/{0}/frames"), Col("p50 (ms)", "per_tier/{0}/p50_ms"),
          Col("p50 vs floor", "per_tier/{0}/p50_ms", base="per_tier/{0}/floor_ms",
              how="ratio")))


def test_paths_reach_dict_keys_with_dots_list_indices_and_globs():
    assert lookup(RESULT, "paced/0.5/p50") == 3.0
    assert lookup(RESULT, "memory/baseline_*/mib") == 60.0
    assert lookup({"xs": [{"a": 1}]}, "xs/0/a") == 1
    assert lookup(RESULT, "per_tier/edge/p50_ms") is None
    assert expand(RESULT, "per_tier/*") == [("local",), ("cloud",)]


def test_cells_compare_with_the_baseline_and_mark_what_does_not_apply():
    acc = Row("accuracy (%)", ("acc/ddnn", "acc/raw"), scale=100.0)
    assert cell(RESULT, Col("v", "{0}"), acc) == "98.9"
    assert cell(RESULT, Col("vs", "{0}", base="{1}", how="diff"), acc) == "+4.2 pt"
    mem = Row("mib", ("memory/this_tree/mib", "memory/baseline_*/mib"))
    assert cell(RESULT, Col("vs", "{0}", base="{1}", how="fewer"), mem) == "4× fewer"
    assert cell(RESULT, Col("vs", "{1}", base="{0}", how="fewer"), mem) == "4× more"
    assert cell(RESULT, Col("vs", "{0}", base="{1}", how="ratio"), Row("x", ("acc/ddnn", "-"))
                ) == "–"


def test_a_section_has_question_table_baseline_aims_plot_command_machine_and_bundle(tmp_path):
    (tmp_path / "latency.png").write_bytes(b"png")
    text = section("latency", RESULT, LATENCY, tmp_path)
    assert "**Question.** How long per exit?" in text
    assert "| exit | frames | p50 (ms) | p50 vs floor |" in text
    assert "| local | 120 | 8 | 2× |" in text and "| cloud | 9 | 20.0 | 4× |" in text
    assert "Baseline: the floor." in text
    assert "✓ p50_within_2x (2 vs 2); ✗ fast" in text
    assert "![latency](latency.png)" in text
    assert "`ddnn bench --only latency`" in text
    assert "Linux-x86_64, 2 CPUs, Python 3.11.7" in text
    assert "2026-11-25 23:40 UTC, 1.5 min" in text and "mvmc:1" in text and "level 2" in text


def test_setup_figures_are_named_by_their_last_name_unless_two_share_it(tmp_path):
    import dataclasses

    spec = dataclasses.replace(LATENCY, setup=("acc/ddnn", "per_tier/local/frames",
                                               "per_tier/cloud/frames"))
    text = section("latency", RESULT, spec, tmp_path)
    assert "Setup: ddnn 0.989; per_tier local frames 120; per_tier cloud frames 9." in text


def test_the_readme_covers_every_json_and_sums_the_measured_wall_times(tmp_path):
    (tmp_path / "soak.json").write_text(json.dumps(RESULT))
    (tmp_path / "mystery.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "broken.json").write_text("{")
    readme = write_readme(tmp_path).read_text()
    assert "## soak" in readme and "## mystery" in readme and "broken" not in readme
    assert "| [soak](#soak) | Running the full hierarchy" in readme
    assert "| 2026-11-25 23:40 | 1.5 |" in readme and "| not stamped | not measured |" in readme
    assert "| **measured total** | | | **2** |" in readme


def test_every_registered_benchmark_has_a_spec():
    from ddnn.benchmarks.cli import BENCHMARKS

    assert set(BENCHMARKS) == set(SPECS)


def test_bench_stamps_each_result_with_its_run_and_says_how_long_it_took_last_time(tmp_path):
    from ddnn.benchmarks.cli import _last_time, _stamp

    (tmp_path / "bundle").mkdir()
    (tmp_path / "bundle" / "manifest.json").write_text(json.dumps({
        "model": {"name": "mvmc", "version": "1"}, "created": "2026-11-25T23:20:00Z",
        "escalation": {"level": 2, "views": 6}, "training": {"epochs": 60, "device": "cpu"}}))
    (tmp_path / "soak.json").write_text(json.dumps({"answered": 3}))
    assert _last_time(tmp_path, "soak") == ""
    run = _stamp(tmp_path, tmp_path, "soak", False, 120.04)["run"]
    assert run["wall_seconds"] == 120.0 and run["command"] == "ddnn bench --only soak"
    assert run["machine"]["cpus"] and run["default_bundle"]["model"] == "mvmc:1"
    assert run["default_bundle"]["escalation"]["level"] == 2
    assert json.loads((tmp_path / "soak.json").read_text())["answered"] == 3
    assert _last_time(tmp_path, "soak") == "; it took 2.0 min last time"
