"""``make test-arm64``: no unit test of the device left out; a plain skip where it cannot run."""

import re
from pathlib import Path

from tests.support.arm64 import DEVICE_TESTS

UNIT = Path(__file__).parent


def test_every_unit_test_of_the_device_runs_on_arm64_too():
    device = {p.name for p in UNIT.glob("test_*.py")
              if re.search(r"^\s*(from|import) ddnn\.device\b", p.read_text(), re.MULTILINE)}
    assert device, "the pattern finds the device's tests"
    missing = device - set(DEVICE_TESTS)
    assert not missing, f"add to tests/support/arm64.py: {missing}"
    assert all((UNIT / name).exists() for name in DEVICE_TESTS)


def test_where_it_cannot_run_it_says_why_and_skips(monkeypatch, capsys, tmp_path):
    import tests.support.arm64 as arm64

    monkeypatch.setenv("DDNN_ARM64_CACHE", str(tmp_path))
    monkeypatch.setattr(arm64.os, "geteuid", lambda: 1000)  # not root
    monkeypatch.delenv("DDNN_ARM64_REQUIRED", raising=False)
    assert arm64.main() == 0
    assert "test-arm64: skipped: needs root" in capsys.readouterr().out
    monkeypatch.setenv("DDNN_ARM64_REQUIRED", "1")
    assert arm64.main() == 1
    assert not any(tmp_path.iterdir()), "nothing built"
