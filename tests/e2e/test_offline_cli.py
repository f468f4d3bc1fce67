"""From nothing to an evaluated bundle with the command line alone, as a user would."""

import json
import os
import subprocess
import sys

import pytest


def ddnn(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddnn", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(("views", "classes", "size"), [(3, 3, 16), (1, 4, 24)])
def test_synth_train_evaluate(tmp_path, views, classes, size):
    train, test, bundle = tmp_path / "train.npz", tmp_path / "test.npz", tmp_path / "bundle"
    shape = ["--views", str(views), "--classes", str(classes), "--size", str(size)]
    for path, n, seed in ((train, 240, 1), (test, 80, 2)):
        proc = ddnn(
            "data", "synth", "--out", str(path), "--samples", str(n), "--seed", str(seed), *shape
        )
        assert proc.returncode == 0, proc.stderr
    proc = ddnn(
        "train",
        "--data",
        str(train),
        "--out",
        str(bundle),
        "--epochs",
        "2",
        "--name",
        "cli-test",
        "--no-progress",
        "--preset",  # the CLI's flow, not the default device: the small one keeps it fast
        "tiny",
    )
    assert proc.returncode == 0, proc.stderr
    assert "thresholds: local" in proc.stderr

    proc = ddnn("evaluate", "--bundle", str(bundle), "--data", str(test), "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["samples"] == 80
    assert set(result["accuracy"]) == {"device", "local", "edge", "cloud", "overall"}
    assert set(result["exit_fraction"]) == {"local", "edge", "cloud"}
    assert sum(result["exit_fraction"].values()) == pytest.approx(1.0)
    assert set(result["bytes_per_frame"]) == {"ddnn", "raw_offload"}
    assert set(result["thresholds"]) == {"local", "edge"}
    assert all(0.0 <= a <= 1.0 for a in result["accuracy"].values())
    assert result["bytes_per_frame"]["ddnn"] < result["bytes_per_frame"]["raw_offload"]

    # Run-time override of the thresholds: 0 sends everything to the cloud.
    proc = ddnn(
        "evaluate",
        "--bundle",
        str(bundle),
        "--data",
        str(test),
        "--json",
        "--local-threshold",
        "0",
        "--edge-threshold",
        "0",
    )
    forced = json.loads(proc.stdout)
    assert forced["exit_fraction"]["cloud"] == 1.0
    assert forced["accuracy"]["overall"] == forced["accuracy"]["cloud"]

    table = ddnn("evaluate", "--bundle", str(bundle), "--data", str(test))
    assert "overall" in table.stdout and "uplink bytes per frame" in table.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["evaluate", "--bundle", "/nonexistent", "--data", "x.npz"], "no such bundle directory"),
        (["train", "--data", "/nonexistent.npz", "--out", "b"], "no such dataset file"),
        (
            ["train", "--data", "x.npz", "--out", "b", "--scheme", "ZZ"],
            "unknown aggregation scheme",
        ),
    ],
)
def test_user_errors_are_one_line_without_traceback(args, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ddnn", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_wrong_dataset_for_bundle(tiny_bundle, tmp_path):
    other = tmp_path / "other.npz"
    assert (
        ddnn(
            "data", "synth", "--out", str(other), "--samples", "8", "--views", "2", "--size", "16"
        ).returncode
        == 0
    )
    proc = ddnn("evaluate", "--bundle", str(tiny_bundle), "--data", str(other))
    assert proc.returncode == 1 and "the bundle expects 3 views" in proc.stderr


def test_help_lists_every_command():
    proc = ddnn("--help")
    assert proc.returncode == 0
    for command in ("data", "train", "evaluate"):
        assert command in proc.stdout


def test_a_missing_extra_is_named_with_its_fix(tiny_bundle, tmp_path):
    # A Python whose path hides fastapi stands for an install without the cloud extra.
    (tmp_path / "fastapi.py").write_text(
        "raise ModuleNotFoundError('No module named fastapi', name='fastapi')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "ddnn", "cloud", "--bundle", str(tiny_bundle),
                        "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "needs the package 'fastapi'" in r.stderr and "ddnn[cloud]" in r.stderr
