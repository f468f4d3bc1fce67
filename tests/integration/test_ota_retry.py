"""Over-the-air targets that outlive outages and restarts (``BundleUpdater``), against a real
HTTP server on loopback: a version the server cannot serve now is retried with backoff and
remembered on disk, a restarted updater takes it up again, and a bundle that is wrong, or that
the tier cannot load, is refused for good while the running one keeps serving."""

from __future__ import annotations

import functools
import threading
from http.server import ThreadingHTTPServer

import pytest

from ddnn.bundle import load_bundle
from ddnn.plumbing.ota import Announcement, BundleUpdater
from ddnn.signing import generate_keypair
from ddnn.tools.broker import free_port
from tests.support.data import version_copy
from tests.support.ota import FAST, Quiet, bundle_updater, serving
from tests.support.polling import wait_for


@pytest.fixture
def setup(tiny_bundle, tmp_path):
    key, pub = generate_keypair(tmp_path / "keys")
    running = load_bundle(version_copy(tiny_bundle, tmp_path / "run" / "tiny", "1", key),
                          public_key=pub)
    version_copy(tiny_bundle, tmp_path / "www" / "b", "2", key)
    updaters: list[BundleUpdater] = []

    def updater(apply, **kw) -> BundleUpdater:
        u = bundle_updater(running, apply, public_key=pub, retry=FAST, tag="edge0", **kw)
        updaters.append(u)
        return u

    yield running, tmp_path / "www", updater
    for u in updaters:
        u.stop()


def test_a_target_is_retried_until_served_and_survives_a_restart(setup):
    running, www, updater = setup
    port = free_port()
    ann = Announcement("tiny", "2", f"http://127.0.0.1:{port}/b")
    applied, announced, retries = [], [], []
    first = updater(applied.append, on_retry=lambda a, why: retries.append(why))
    first.on_message(ann.to_bytes())  # nothing listens on the port yet
    target = running.path.parent / ".ddnn-ota" / "target-edge0.json"
    assert Announcement.parse(target.read_bytes()) == ann
    wait_for(lambda: first.failures >= 3, 10, "three failed fetches")
    assert "ConnectionRefusedError" in retries[0] and first.refused == 0
    assert first.status()["target"] == "tiny:2" and first.running is running
    first.stop()  # the tier stops (or crashes) before the server comes back

    again = updater(applied.append, on_announce=announced.append)
    assert announced == [ann], "the saved target is announced again at once"
    with serving(www, port):
        wait_for(lambda: again.applied, 20, "the update applied")
    assert [b.manifest.version for b in applied] == ["2"]
    assert again.running.manifest.version == "2" and again.status()["target"] is None
    assert not target.exists(), "applied: the target is cleared"


def test_a_server_that_answers_503_is_retried(setup):
    _, www, updater = setup
    answers = iter([503, 503])

    class Flaky(Quiet):
        def do_GET(self):
            code = next(answers, None)
            if code is None:
                return super().do_GET()
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Flaky, directory=str(www)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        applied = []
        u = updater(applied.append)
        u.on_message(Announcement("tiny", "2", f"http://127.0.0.1:"
                                                f"{server.server_address[1]}/b").to_bytes())
        # (the count of updates applied is the updater's last step: the tier's hook runs first)
        wait_for(lambda: u.applied, 20, "the update applied after two 503s")
        assert applied and u.failures == 0 and u.refused == 0
    finally:
        server.shutdown()
        server.server_close()


def test_a_bundle_the_tier_cannot_load_is_refused_and_the_old_one_serves(setup):
    running, www, updater = setup
    results = []

    def apply(bundle):
        raise RuntimeError("the runtime cannot load it")

    u = updater(apply, on_result=results.append)
    with serving(www, port := free_port()):
        u.on_message(Announcement("tiny", "2", f"http://127.0.0.1:{port}/b").to_bytes())
        wait_for(lambda: results, 20, "the update's outcome")
    assert results == [False] and u.running is running and u.refused == 1
    assert "cannot load it" in u.last_error
    ota = running.path.parent / ".ddnn-ota"
    assert sorted(p.name for p in ota.iterdir()) == [], "no staged copy, no target left"
    assert u.status()["target"] is None, "refused for good: not retried"


def test_a_tampered_bundle_is_refused_not_retried(setup):
    running, www, updater = setup
    onnx = next((www / "b").glob("*.onnx"))
    onnx.write_bytes(onnx.read_bytes()[:-4] + b"XXXX")
    results = []
    u = updater(lambda b: None, on_result=results.append)
    with serving(www, port := free_port()):
        u.on_message(Announcement("tiny", "2", f"http://127.0.0.1:{port}/b").to_bytes())
        wait_for(lambda: results, 20, "the update's outcome")
    assert results == [False] and "checksum" in u.last_error and u.failures == 0
    assert not (running.path.parent / ".ddnn-ota" / "target-edge0.json").exists()
