"""Automatic rollback (``BundleUpdater`` with a probation), against a real HTTP server on
loopback and signed bundles: a version that fails its health check on probation is swapped out
for the previous one, which stays on disk until then; the retained announcement that still names
it does not bring it back, in this process or the next; a newer version is still applied; a
process that dies during probation rolls the version back at its next start."""

from __future__ import annotations

import pytest

from ddnn.bundle import load_bundle
from ddnn.plumbing.ota import Announcement, BundleUpdater
from ddnn.plumbing.probation import CRASHED, Look
from ddnn.signing import generate_keypair
from ddnn.tools.broker import free_port
from tests.support.data import version_copy
from tests.support.ota import FAST, bundle_updater, serving
from tests.support.polling import wait_for

WINDOW = 0.8  # seconds of probation: failing for 0.2 s rolls back


class Probe:
    """Failing while ``bad`` versions run."""

    def __init__(self, bad: set[str]):
        self.bad, self.running = bad, None

    def begin(self) -> None:
        pass

    def look(self) -> Look:
        if self.running in self.bad:
            return Look(problems=(f"{self.running}: segment raised",))
        return Look(worked=True)


@pytest.fixture
def fleet(tiny_bundle, tmp_path):
    key, pub = generate_keypair(tmp_path / "keys")
    running = load_bundle(version_copy(tiny_bundle, tmp_path / "run" / "tiny", "1", key),
                          public_key=pub)
    for v in ("2", "3"):
        version_copy(tiny_bundle, tmp_path / "www" / v, v, key)
    made: list[BundleUpdater] = []

    def updater(probe: Probe, applied: list, **kw) -> BundleUpdater:
        def apply(bundle):
            applied.append(bundle.ref)
            probe.running = bundle.ref

        u = bundle_updater(running, apply, public_key=pub, retry=FAST, tag="dev0",
                          probation=WINDOW, probe=probe, **kw)
        made.append(u)
        return u

    port = free_port()
    with serving(tmp_path / "www", port):
        yield running, updater, lambda v: Announcement("tiny", v, f"http://127.0.0.1:{port}/{v}")
    for u in made:
        u.stop()


def test_a_version_failing_on_probation_is_rolled_back_and_not_applied_again(fleet):
    running, updater, ann = fleet
    probe, applied, rollbacks, announced = Probe({"tiny:2"}), [], [], []
    u = updater(probe, applied, on_rollback=lambda ref, why: rollbacks.append((ref, why)))
    u.on_message(ann("2").to_bytes())
    wait_for(lambda: rollbacks, 20, "the rollback")
    assert applied == ["tiny:2", "tiny:1"] and u.running.ref == "tiny:1"
    assert rollbacks[0][0] == "tiny:2" and "segment raised" in rollbacks[0][1]
    status = u.status()
    assert status["rolled_back_from"] == "tiny:2" and status["probation"] is None
    staging = running.path.parent / ".ddnn-ota"
    assert running.path.exists() and not (staging / "tiny-2-dev0").exists()

    u.on_message(ann("2").to_bytes())  # the retained announcement, at a reconnection
    assert u.status()["target"] is None and applied == ["tiny:2", "tiny:1"]
    u.stop()

    # The next process: the retained announcement still names version 2; it stays refused,
    # but is announced to the tier (devices may run it; its wire format is this one's), at
    # start already, before any device message can come.
    again = updater(probe, applied, on_announce=announced.append)
    assert announced == [Announcement("tiny", "2")]
    again.on_message(ann("2").to_bytes())
    assert again.status()["target"] is None and announced[1:] == [ann("2")]
    assert applied == ["tiny:2", "tiny:1"]

    # A newer version is still applied, passes, and the version before it is kept no longer.
    again.on_message(ann("3").to_bytes())
    wait_for(lambda: again.running.ref == "tiny:3" and again.status()["probation"] is None,
             20, "version 3 applied and past its probation")
    assert applied[-1] == "tiny:3" and again.guard.good.ref == "tiny:3"
    assert (staging / "tiny-3-dev0").exists() and running.path.exists()


def test_a_process_that_dies_during_probation_rolls_the_version_back_at_start(fleet):
    running, updater, ann = fleet
    probe, applied, rollbacks = Probe(set()), [], []
    u = updater(probe, applied)
    u.on_message(ann("2").to_bytes())
    wait_for(lambda: u.applied == 1, 20, "version 2 applied")
    assert applied == ["tiny:2"] and u.status()["probation"]["version"] == "tiny:2"
    u.stop(clean=False)  # the tier failed (a segment raised out of the frame loop)

    again = updater(probe, applied, on_rollback=lambda ref, why: rollbacks.append((ref, why)))
    assert rollbacks == [("tiny:2", CRASHED)] and again.running is running
    again.on_message(ann("2").to_bytes())
    assert again.status()["target"] is None and applied == ["tiny:2"]
