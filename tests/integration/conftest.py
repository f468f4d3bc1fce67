"""Integration fixtures. Cloud: the real service under uvicorn on a free loopback port."""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    """Poll ``condition`` until it returns something truthy, and return that (no guessed sleep)."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return result


# BundleUpdater's option groups and hooks, from the flat keywords the OTA tests speak.
_HOOKS = ("on_result", "on_announce", "on_retry", "on_refused", "on_rollback")
_POLICY = ("allow_unsigned", "allow_downgrade", "probation")
_SOURCE = {"cloud": "origin", "token": "token", "ca_file": "ca_file", "cert_file": "cert_file",
           "key_file": "key_file"}


def bundle_updater(running, apply, **kw):
    """A started :class:`BundleUpdater` of ``running`` applying with ``apply``; ``kw``: its
    keywords, or a hook, a policy or a source field by name (``cloud`` is the source's
    origin)."""
    from ddnn.plumbing.ota import BundleUpdater
    from ddnn.plumbing.ota_settings import UpdateHooks, UpdatePolicy, UpdateSource

    hooks = UpdateHooks(apply=apply, **{k: kw.pop(k) for k in _HOOKS if k in kw})
    policy = UpdatePolicy(**{k: kw.pop(k) for k in _POLICY if k in kw})
    source = UpdateSource(**{v: kw.pop(k) for k, v in _SOURCE.items() if k in kw})
    return BundleUpdater(running, hooks, policy=policy, source=source, **kw).start()


def cloud_wait_ready(url: str, timeout: float = 30.0, **client_args) -> None:
    """Poll ``/v2/health/ready`` until it answers 200 (readiness, not a guessed sleep)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, timeout=2.0, **client_args) as client:
        while True:
            try:
                if client.get("/v2/health/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} is not ready after {timeout} s")
            time.sleep(0.02)


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
                cloud_wait_ready(running.url)
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
        cloud_wait_ready(running.url)
        yield running.url
