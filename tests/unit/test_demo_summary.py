"""The demo's summary: each tier's share and its accuracy on the frames it answered (issue
23.6), beside the offline evaluation's shares."""

from types import SimpleNamespace

import numpy as np

from ddnn.tools.demo import _summary, _table


def _offline() -> dict:
    return {"exit_fraction": {"local": 0.5, "edge": 0.25, "cloud": 0.25},
            "accuracy": {"overall": 0.75, "cloud": 0.8},
            "bytes_per_frame": {"ddnn": 40.0, "raw_offload": 9216.0}}


def test_each_tier_reports_its_share_and_its_accuracy():
    labels = np.array([0, 1, 2, 0, 1])
    answers = [(0, "local"), (1, "local"), (0, "edge"), (0, "edge"), (1, "edge")]
    results = {i: {"frame": i, "class": c, "exit": t, "latency_ms": 1.0 + i, "degraded": False}
               for i, (c, t) in enumerate(answers)}
    ds = SimpleNamespace(num_samples=5, label=labels)
    s = _summary(results, ds, _offline(), 200.0, SimpleNamespace(name="demo", version="1"))
    assert s["exits"] == {"local": 2, "edge": 3, "cloud": 0}
    assert s["accuracy_by_exit"] == {"local": 1.0, "edge": 2 / 3, "cloud": None}
    assert s["live_accuracy"] == 0.8
    rows = {line.split()[0]: line.split() for line in _table(s).splitlines()[3:6]}
    assert rows["local"][1:5] == ["2", "0.400", "0.500", "1.000"]
    assert rows["edge"][1:5] == ["3", "0.600", "0.250", "0.667"]
    assert rows["cloud"][1:5] == ["0", "0.000", "0.250", "-"]
    assert "stacked exits" not in _table(s)  # a bundle whose exits answer alone
    stacked = {**_offline(), "stacking": {"edge": 0.5, "cloud": 0.0, "escalated": 1.0}}
    s = _summary(results, ds, stacked, 200.0, SimpleNamespace(name="demo", version="1"))
    assert _table(s).endswith("stacked exits: edge = 0.5 own + 0.5 local; cloud = 0 own + 1 edge")


def test_a_frame_no_camera_saw_is_left_out_of_every_accuracy():
    labels = np.array([0, 1, 2])
    results = {0: {"frame": 0, "class": 0, "exit": "local", "latency_ms": 1.0},
               1: {"frame": 1, "class": None, "exit": "none", "latency_ms": 1.0},
               2: {"frame": 2, "class": 1, "exit": "cloud", "latency_ms": 1.0}}
    ds = SimpleNamespace(num_samples=3, label=labels)
    s = _summary(results, ds, _offline(), 60.0, SimpleNamespace(name="demo", version="1"))
    assert s["no_view"] == 1 and s["live_accuracy"] == 0.5
    assert s["accuracy_by_exit"] == {"local": 1.0, "edge": None, "cloud": 0.0}


def test_the_checks_the_demo_proves_itself_by():
    labels = np.array([0, 1, 2, 0])
    results = {0: {"frame": 0, "class": 0, "exit": "local", "latency_ms": 1.0},
               1: {"frame": 1, "class": 1, "exit": "edge", "latency_ms": 1.0},
               2: {"frame": 2, "class": 2, "exit": "cloud", "latency_ms": 1.0}}
    ds = SimpleNamespace(num_samples=4, label=labels)
    m = SimpleNamespace(name="demo", version="1")
    offline = {0: ("local", 0), 1: ("edge", 1), 2: ("cloud", 2), 3: ("local", 0)}
    s = _summary(results, ds, _offline(), 60.0, m, offline)
    assert s["checks"] == {"every_frame_answered": False, "live_equals_offline": True,
                           "every_tier_answers": True}
    results[3] = {"frame": 3, "class": 1, "exit": "edge", "latency_ms": 1.0}  # offline: local
    s = _summary(results, ds, _offline(), 60.0, m, offline)
    assert s["checks"]["every_frame_answered"] and not s["checks"]["live_equals_offline"]
    assert s["differ_from_offline"] == [3] and s["differ_count"] == 1
    assert "live equals offline FAILED" in _table(s) and "(1 frames differ" in _table(s)
    del results[2]  # the cloud answers nothing
    s = _summary(results, SimpleNamespace(num_samples=2, label=labels[:2]), _offline(), 60.0,
                 m, offline)
    assert not s["checks"]["every_tier_answers"] and s["checks"]["live_equals_offline"]
    # Without the offline answers nothing can be said to equal them.
    assert not _summary(results, ds, _offline(), 60.0, m)["checks"]["live_equals_offline"]


def test_the_stages_count_the_cpu_seconds_of_the_children_that_ran_them():
    import subprocess
    import sys

    from ddnn.tools.demo import Stages

    stages = Stages()
    with stages.stage("data"):  # a child's CPU counts once it has ended
        subprocess.run([sys.executable, "-c", "sum(range(10**7))"], check=True)
    with stages.stage("train"):
        pass
    with stages.stage("data"):
        pass
    assert list(stages.seconds) == ["data", "train"]
    assert stages.seconds["data"]["cpu_s"] > 0 and stages.seconds["train"]["cpu_s"] >= 0
    s = _summary({}, SimpleNamespace(num_samples=0, label=np.array([])), _offline(), None,
                 SimpleNamespace(name="demo", version="1"))
    s["stages"] = {"data": {"cpu_s": 1.25, "wall_s": 2.0}, "train": {"cpu_s": 30, "wall_s": 20}}
    assert "stages, CPU s (wall s): data 1.2 (2.0), train 30.0 (20.0)" in _table(s)
