"""Shared fixtures: small generated datasets, a trained bundle, real brokers on free ports.

Everything is made by the project itself (no downloads) and sized to keep the suite fast on a
2-core machine: 3 views, 3 classes, 16×16 images, a few epochs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddnn.tools.broker import BrokerProcess, mosquitto_path, start_broker


@dataclass(frozen=True)
class TinyData:
    train: Path
    test: Path
    views: int = 3
    classes: int = 3
    size: int = 16


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    """A generated train and test file in the dataset contract's layout."""
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    root = tmp_path_factory.mktemp("data")
    cfg = SceneConfig(views=3, classes=3, size=16)
    data = TinyData(root / "train.npz", root / "test.npz")
    save_dataset(data.train, synthesize(360, cfg, seed=1))
    save_dataset(data.test, synthesize(120, cfg, seed=2))
    return data


@pytest.fixture(scope="session")
def tiny_bundle(tiny_data, tmp_path_factory) -> Path:
    """A bundle trained for a few epochs on ``tiny_data`` (read-only: copy it to modify it)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig

    out = tmp_path_factory.mktemp("bundles") / "tiny"
    # The paper's network, pinned: the tier tests know its tensor shapes and codecs (device
    # features (4, 8, 8) binary, edge features (16, 4, 4) binary) whatever the model defaults;
    # tests/integration/test_export_parity.py and tests/unit/test_models_network.py cover those.
    cfg = DDNNConfig.paper(epochs=4, batch_size=32, seed=0)
    build_bundle(
        tiny_data.train, out, cfg, name="tiny", version="1", progress=False, log=lambda *_: None
    )
    return out


def one_epoch_bundle(root: Path, views: int) -> Path:
    """A ``tiny`` bundle of ``views`` views, trained one short epoch (for tests of the tiers,
    not of accuracy)."""
    from ddnn.models.build import build_bundle
    from ddnn.models.config import DDNNConfig
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    save_dataset(root / "train.npz", synthesize(60, SceneConfig(views=views, classes=3, size=16),
                                                seed=1))
    build_bundle(root / "train.npz", root / "tiny",
                 DDNNConfig.paper(epochs=1, batch_size=32, seed=0),  # pinned, as tiny_bundle
                 name="tiny", version="1", progress=False, log=lambda *_: None)
    return root / "tiny"


@pytest.fixture(scope="session")
def one_view_bundle(tmp_path_factory) -> Path:
    """A one-view bundle (the device decides its own exit)."""
    return one_epoch_bundle(tmp_path_factory.mktemp("one-view"), views=1)


@pytest.fixture
def mosquitto() -> BrokerProcess:
    """A real Mosquitto broker on a free loopback port, stopped after the test."""
    if mosquitto_path() is None:
        message = "mosquitto is not installed (apt-get install mosquitto; `make test` does)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the broker tests, not skip them
        pytest.skip(message)
    broker = start_broker(prefer="mosquitto")
    yield broker
    broker.stop()


# The tier folders are importable only as ddnn.<tier>: the repository root is on the test path
# (pythonpath), so `import edge` would load edge/ again as a second module object beside
# ddnn.edge, whose state would silently split in two. ruff's banned-api (TID251) refuses such
# imports in the code; this catches any that slip through at run time (a string given to
# importlib, a subprocess's code...), at the end of the session.
TIER_FOLDERS = ("device", "edge", "cloud", "models", "benchmarks")


def pytest_sessionfinish(session, exitstatus) -> None:
    doubles = sorted(name for name in TIER_FOLDERS if name in sys.modules)
    if doubles:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = (f"top-level modules {', '.join(doubles)} were imported: a tier folder is "
                   f"imported as ddnn.<tier> only (one module object per module)")
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message, file=sys.stderr)
