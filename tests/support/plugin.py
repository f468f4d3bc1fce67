"""The test suite's pytest plugin (loaded by ``tests/conftest.py``): its fixtures, one marker
per tier, and the check of import names at the end of the session.

Fixtures start real parts on free loopback ports and stop them after the test: a trained tiny
bundle, generated data, Mosquitto, the cloud service (in this process, or as a ``ddnn cloud``
process). Markers: ``pytest -m edge`` runs the tests of the edge tier (likewise ``device``,
``cloud``, ``models``, ``contract``, ``plumbing``); a test of the whole hierarchy carries the
marker of each tier it runs.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddnn.tools.broker import BrokerProcess, free_port, mosquitto_path, start_broker
from tests.support.data import (
    STREAM,
    TinyData,
    drift_bundle,
    make_tiny_data,
    one_epoch_bundle,
    train_tiny_bundle,
)
from tests.support.data import (
    kinds_repository as kinds_repository_of,
)
from tests.support.polling import wait_for
from tests.support.processes import ddnn_process, http_ok, stop_process

MARKERS = {
    "contract": "the shared contract in ddnn/: envelope, codec, topics, bundle, results...",
    "plumbing": "what the tiers share but no contract defines: MQTT, HTTP, options, updates",
    "device": "the device agent and the site gateway",
    "edge": "the edge aggregator",
    "cloud": "the cloud service",
    "models": "the offline side: data, network, training, export",
}
HIERARCHY = ("device", "edge", "cloud")
# Test module -> the tiers it tests (a module named test_<tier>_* needs no entry).
TIERS: dict[str, tuple[str, ...]] = {
    # unit
    "test_aggregation": ("contract",), "test_alias_bookkeeping": ("plumbing",),
    "test_assembler": ("edge",), "test_batch": ("contract",),
    "test_camera_clock_skew": ("device",), "test_coalescer": ("device",),
    "test_codec": ("contract",), "test_dataset": ("contract",),
    "test_envelope": ("contract",), "test_envelope_fuzz": ("contract",),
    "test_exits": ("contract",), "test_gateway_parts": ("device",),
    "test_hostile_policy": ("plumbing", "cloud"), "test_import": ("models",),
    "test_keepalive": ("plumbing",), "test_limits": ("contract",), "test_names": ("contract",),
    "test_oip": ("contract",), "test_ota_announcement": ("plumbing",),
    "test_ota_probation": ("plumbing", "device", "edge"),
    "test_packed_features": ("contract", "edge", "cloud"), "test_repeated_features": ("edge",),
    "test_packed_detail": ("contract", "edge", "cloud"),
    "test_result": ("contract",), "test_retry": ("plumbing",), "test_signing": ("contract",),
    "test_synth": ("models",), "test_throttle": ("plumbing",), "test_topics": ("contract",),
    "test_versions": ("contract",),
    # integration
    "test_announce_secure": ("plumbing",), "test_broker_sessions": ("plumbing",),
    "test_bundle": ("contract",), "test_deploy": (*HIERARCHY, "plumbing"),
    "test_distributed_training": ("models",), "test_export_parity": ("models",),
    "test_gateway": ("device", "edge"), "test_health": ("device", "edge"),
    "test_hostile_broker": ("plumbing",), "test_hostile_cloud": ("cloud",),
    "test_hostile_edge_http": ("edge",), "test_hostile_ota": ("plumbing",),
    "test_hostile_pulls": ("device",), "test_ota_retry": ("plumbing",),
    "test_paho_versions": ("plumbing",), "test_results_callback": ("edge",),
    "test_security": (*HIERARCHY, "plumbing"), "test_topic_aliases": ("plumbing",),
    "test_unreachable_broker": ("device", "edge", "plumbing"),
    "test_updater_rollback": ("plumbing",), "test_without_torch": ("device", "contract"),
    # end to end
    "test_offline_cli": ("models",), "test_readme": (*HIERARCHY, "models"),
}
PREFIXES = {"test_device_": ("device",), "test_edge_": ("edge",), "test_cloud_": ("cloud",),
            "test_cloud": ("cloud",), "test_models_": ("models",)}


def tiers_of(item: pytest.Item) -> tuple[str, ...]:
    """The tiers a test is of: its module's entry, its name's prefix, or (end to end) all."""
    module = Path(str(item.fspath)).stem
    if module in TIERS:
        return TIERS[module]
    for prefix, tiers in PREFIXES.items():
        if module.startswith(prefix):
            return tiers
    return HIERARCHY if "e2e" in Path(str(item.fspath)).parts else ()


def pytest_configure(config: pytest.Config) -> None:
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for tier in tiers_of(item):
            item.add_marker(getattr(pytest.mark, tier))


# The tier folders are importable only as ddnn.<tier>: the repository root is on the test path
# (pythonpath), so `import edge` would load edge/ again as a second module object beside
# ddnn.edge, whose state would silently split in two. ruff's banned-api (TID251) refuses such
# imports in the code; this catches any that slip through at run time (a string given to
# importlib, a subprocess's code...), at the end of the session.
TIER_FOLDERS = ("device", "edge", "cloud", "models", "benchmarks")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
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


# --- state ---------------------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def _session_state(tmp_path_factory) -> Iterator[None]:
    """Devices keep their state (the default spool, per deployment and device id) under
    ``$XDG_STATE_HOME``: never the user's during tests, also for module-scoped fixtures."""
    saved = {k: os.environ.get(k) for k in ("XDG_STATE_HOME", "STATE_DIRECTORY")}
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state"))
    os.environ.pop("STATE_DIRECTORY", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def device_state(tmp_path_factory, monkeypatch) -> Path:
    """Each test's own state directory: its devices never find another test's spool."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    return state


# --- data and bundles ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    """A generated train and test file in the dataset contract's layout."""
    return make_tiny_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="session")
def tiny_bundle(tiny_data, tmp_path_factory) -> Path:
    """A bundle trained for a few epochs on ``tiny_data`` (read-only: copy it to modify it).

    ``DDNN_TEST_TINY_BUNDLE`` names one trained elsewhere by :func:`train_tiny_bundle`: the
    arm64 userland of tests/support/arm64.py runs the device's tests without torch.
    """
    prebuilt = os.environ.get("DDNN_TEST_TINY_BUNDLE")
    if prebuilt:
        return Path(prebuilt)
    return train_tiny_bundle(tiny_data, tmp_path_factory.mktemp("bundles") / "tiny")


@pytest.fixture(scope="session")
def kinds_repository(tiny_data, tiny_bundle, tmp_path_factory) -> Path:
    """A repository with a bundle of every kind the cloud serves (read-only):
    :func:`tests.support.data.kinds_repository`."""
    return kinds_repository_of(tiny_data, tiny_bundle, tmp_path_factory.mktemp("kinds"))


@pytest.fixture(scope="session")
def one_view_bundle(tmp_path_factory) -> Path:
    """A one-view bundle (the device decides its own exit)."""
    return one_epoch_bundle(tmp_path_factory.mktemp("one-view"), views=1)


@pytest.fixture(scope="session")
def drift_home_bundle(tmp_path_factory) -> Path:
    """A bundle trained on the home domain of ``DRIFT_SCENE`` (read-only: copy it to modify
    it), shared by the drift and closed-loop tests."""
    return drift_bundle(tmp_path_factory.mktemp("drift-home"))


@pytest.fixture(scope="session")
def stream_data(tmp_path_factory) -> Path:
    """A longer test replay than ``tiny_data.test``, in the same layout (3 views, 3 classes)."""
    from ddnn.models.synth import SceneConfig, save_dataset, synthesize

    path = tmp_path_factory.mktemp("stream") / "stream.npz"
    save_dataset(path, synthesize(STREAM, SceneConfig(views=3, classes=3, size=16), seed=3))
    return path


# --- a broker -----------------------------------------------------------------------------------

@pytest.fixture
def mosquitto() -> Iterator[BrokerProcess]:
    """A real Mosquitto broker on a free loopback port, stopped after the test."""
    if mosquitto_path() is None:
        message = "mosquitto is not installed (apt-get install mosquitto; `make test` does)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must run the broker tests, not skip them
        pytest.skip(message)
    broker = start_broker(prefer="mosquitto")
    yield broker
    broker.stop()


# --- the cloud ----------------------------------------------------------------------------------

def _cloud_wait_ready(url: str) -> None:
    # Imported here: the cloud's helpers need httpx, which the device tier's tests on an arm64
    # board (the device extra alone: tests/support/arm64.py) do not have.
    from tests.support.cloud import cloud_wait_ready

    cloud_wait_ready(url)


@pytest.fixture
def cloud_server():
    """Factory: ``start(**settings)`` runs the cloud service in a thread and returns its URL.

    Every server started is stopped when the test ends.
    """
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings

    with contextlib.ExitStack() as stack:

        def start(wait_ready: bool = True, **settings) -> str:
            settings.setdefault("host", "127.0.0.1")
            settings.setdefault("port", 0)
            running = stack.enter_context(run_server(CloudSettings(**settings)))
            if wait_ready:
                _cloud_wait_ready(running.url)
            return running.url

        yield start


@pytest.fixture(scope="module")
def cloud_tiny_url(tiny_bundle):
    """One cloud service for a module's tests, serving ``tiny_bundle`` with batching on."""
    from ddnn.cloud.server import run_server
    from ddnn.cloud.settings import CloudSettings

    settings = CloudSettings(bundle=tiny_bundle, host="127.0.0.1", port=0, poll_interval=0,
                             max_queue_delay_ms=5.0)
    with run_server(settings) as running:
        _cloud_wait_ready(running.url)
        yield running.url


@pytest.fixture(scope="module")
def cloud_url(tiny_bundle, tmp_path_factory) -> Iterator[str]:
    """The cloud tier: a real ``ddnn cloud`` process on a free loopback port, ready before the
    test starts."""
    logs = tmp_path_factory.mktemp("cloud")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ddnn_process(["cloud", "--bundle", str(tiny_bundle), "--host", "127.0.0.1",
                         "--port", str(port), "--ort-threads", "1"], logs / "cloud.log")
    wait_for(lambda: http_ok(f"{url}/v2/health/ready"), 60, "ddnn cloud ready", [proc])
    yield url
    stop_process(proc)
