"""``make test-arm64`` runs the device's unit tests on aarch64: none of them may be left out."""

import re
from pathlib import Path

from tests.arm64.run import DEVICE_TESTS

UNIT = Path(__file__).parent


def test_every_unit_test_of_the_device_runs_on_arm64_too():
    device = {p.name for p in UNIT.glob("test_*.py")
              if re.search(r"^\s*(from|import) ddnn\.device\b", p.read_text(), re.MULTILINE)}
    assert device, "the pattern finds the device's tests"
    assert device <= set(DEVICE_TESTS), f"add to tests/arm64/run.py: {device - set(DEVICE_TESTS)}"
    assert all((UNIT / name).exists() for name in DEVICE_TESTS)
