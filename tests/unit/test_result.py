"""The Result contract: built, validated and serialised in one place; the schema in the docs."""

import json
from pathlib import Path

import jsonschema_rs
import pytest

from ddnn.result import Result, ResultError, json_schema, result_for, unanswered

ROOT = Path(__file__).resolve().parents[2]
CLASSES = ("car", "bus", "person")


def _result(**kw) -> Result:
    args = dict(frame=17, scores=[0.1, 0.2, 3.0], classes=CLASSES, exit="local", entropy=0.12,
                views=["cam0", "cam2"], missing={"cam1": "absent", "cam3": "late"})
    return result_for(**{**args, **kw})


def test_the_design_example_round_trips():
    r = _result()
    d = json.loads(r.to_json())
    assert d == {"frame": 17, "class": 2, "label": "person", "exit": "local", "entropy": 0.12,
                 "views": ["cam0", "cam2"], "missing": {"cam1": "absent", "cam3": "late"},
                 "partial": True, "degraded": False, "latency_ms": 0.0}
    assert Result.from_json(r.to_json()) == r


def test_absent_views_do_not_make_a_frame_partial():
    assert not _result(missing={"cam1": "absent"}).partial
    for reason in ("late", "offline", "no_features"):
        assert _result(missing={"cam1": reason}).partial


@pytest.mark.parametrize(("change", "why"), [
    ({"frame": -1}, "frame"), ({"frame": 1.5}, "frame"), ({"class": "2"}, "class"),
    ({"label": ""}, "label"), ({"exit": "fog"}, "exit"), ({"entropy": float("nan")}, "entropy"),
    ({"latency_ms": -3}, "latency_ms"), ({"degraded": 1}, "degraded"),
    ({"views": "cam0"}, "views"), ({"views": ["cam0", "cam0"]}, "views"),
    ({"views": ["Cam0"]}, "views"), ({"missing": {"cam1": "lost"}}, "missing"),
    ({"missing": {"cam0": "late"}, "partial": True}, "both fused and missing"),
    ({"partial": False}, "partial"), ({"extra": 1}, "exactly the keys"),
])
def test_bad_results_are_refused_with_the_field_named(change, why):
    d = {**json.loads(_result().to_json()), **change}
    with pytest.raises(ResultError, match=why):
        Result.from_dict(d)


def test_a_frame_no_view_was_fused_in_is_not_classified():
    r = unanswered(frame=18, missing={"cam0": "absent", "cam1": "absent"}, latency_ms=2.0)
    d = json.loads(r.to_json())
    assert d == {"frame": 18, "class": None, "label": None, "exit": "none", "entropy": None,
                 "views": [], "missing": {"cam0": "absent", "cam1": "absent"},
                 "partial": False, "degraded": False, "latency_ms": 2.0}
    assert Result.from_json(r.to_json()) == r and not r.answered and _result().answered
    assert unanswered(frame=1, missing={"cam0": "late"}).partial  # a view came, too late


@pytest.mark.parametrize(("change", "why"), [
    ({"class": 2}, "null class"), ({"label": "car"}, "null class"), ({"entropy": 0.1}, "null"),
    ({"views": ["cam0"], "missing": {}}, "views must be"), ({"class": None, "exit": "local"},
                                                            "class"),
])
def test_an_unclassified_frame_is_all_or_nothing(change, why):
    d = {**json.loads(unanswered(frame=3, missing={"cam0": "absent"}).to_json()), **change}
    with pytest.raises(ResultError, match=why):
        Result.from_dict(d)


def test_junk_is_a_result_error():
    for junk in (b"\xff{", b"[" * 100_000, b"null", b'"x"', b"x" * 70_000):
        with pytest.raises(ResultError):
            Result.from_json(junk)


def test_the_schema_in_the_docs_is_the_contract():
    on_disk = json.loads((ROOT / "docs" / "result.schema.json").read_text())
    assert on_disk == json_schema(), "regenerate: python -m ddnn.tools.docs"
    validator = jsonschema_rs.validator_for(on_disk)
    assert validator.is_valid(json.loads(_result().to_json()))
    assert validator.is_valid(json.loads(_result(missing={}, exit="cloud").to_json()))
    assert not validator.is_valid({**json.loads(_result().to_json()), "exit": "fog"})
    none = json.loads(unanswered(frame=3, missing={"cam0": "absent"}).to_json())
    assert validator.is_valid(none)
    assert not validator.is_valid({**none, "class": 1})
    assert not validator.is_valid({**json.loads(_result().to_json()), "class": None})
