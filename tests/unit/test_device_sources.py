"""Frame sources that run unattended: a camera that fails is reopened with backoff and the agent
exits non-zero only when it gives up; a followed image folder is read as a capture tool fills
it, and what was sent is deleted or archived.

OpenCV is replaced by a fake ``cv2`` module (the tests need no camera and no OpenCV).
"""

from __future__ import annotations

import sys
import threading
import time
import types

import numpy as np
import pytest

from ddnn.device.sources import Camera, ImageFolder, NpzReplay, SourceError
from ddnn.plumbing.retry import RetryPolicy
from tests.support.polling import wait_for

FAST = RetryPolicy(initial=0.01, maximum=0.02)


class Script:
    """What the fake camera does: ``opens[i]`` says whether the i-th opening works; each
    opened capture yields ``frames_per_open`` frames, then its reads fail."""

    def __init__(self, opens: list[bool], frames_per_open: int):
        self.opens, self.frames_per_open = list(opens), frames_per_open
        self.opened = 0
        self.released = 0


def fake_cv2(script: Script) -> types.ModuleType:
    class VideoCapture:
        def __init__(self, index: int):
            self.ok = script.opens.pop(0) if script.opens else False
            self.left = script.frames_per_open
            script.opened += 1

        def isOpened(self) -> bool:  # OpenCV's name
            return self.ok

        def set(self, prop: int, value: float) -> bool:
            return True

        def read(self):
            if not self.ok or self.left == 0:
                return False, None
            self.left -= 1
            return True, np.full((8, 8, 3), 100, np.uint8)

        def release(self) -> None:
            script.released += 1

    return types.SimpleNamespace(VideoCapture=VideoCapture, CAP_PROP_BUFFERSIZE=38)


@pytest.fixture
def camera_script(monkeypatch):
    def install(opens: list[bool], frames_per_open: int) -> Script:
        script = Script(opens, frames_per_open)
        monkeypatch.setitem(sys.modules, "cv2", fake_cv2(script))
        return script
    return install


def test_a_camera_whose_reads_fail_is_reopened_and_goes_on(camera_script):
    script = camera_script([True, False, False, True], frames_per_open=3)
    cam = Camera(0, (3, 4, 4), limit=6, fps=1e6, retries=5, retry=FAST)
    frames = list(cam)
    assert len(frames) == 6  # 3, then two failed reopenings, then 3 more
    ids = [f for f, _ in frames]
    assert ids == sorted(ids) and len(set(ids)) == 6
    assert frames[0][1].shape == (3, 4, 4)
    assert script.opened == 4 and cam.reopened == 1 and cam.problem is None


def test_a_camera_gives_up_after_its_retries(camera_script):
    script = camera_script([True], frames_per_open=2)
    cam = Camera(0, (3, 4, 4), fps=1e6, retries=3, retry=FAST)
    got = []
    with pytest.raises(SourceError, match="after 3 reopenings"):
        for frame in cam:
            got.append(frame)
    assert len(got) == 2 and script.opened == 4  # the first opening and three more
    assert "reopening" in cam.problem


def test_a_camera_missing_at_start_is_waited_for(camera_script):
    camera_script([False, False, True], frames_per_open=1)
    cam = Camera(0, (3, 4, 4), limit=1, fps=1e6, retries=5, retry=FAST)
    assert cam.problem is not None
    assert len(list(cam)) == 1


def test_a_stopped_camera_stops_waiting(camera_script):
    camera_script([], frames_per_open=0)  # never opens
    cam = Camera(0, (3, 4, 4), fps=10, retries=0, retry=RetryPolicy(initial=30, maximum=30))
    stopper = threading.Timer(0.2, cam.stop_event.set)
    stopper.start()
    t0 = time.monotonic()
    assert list(cam) == []
    assert time.monotonic() - t0 < 10


def test_the_device_exits_non_zero_when_its_camera_gives_up(camera_script, tiny_bundle):
    from ddnn.cli import main

    camera_script([True], frames_per_open=3)
    code = main(["device", "--bundle", str(tiny_bundle), "--view", "0", "--camera", "0",
                 "--fps", "1000", "--edge-url", "http://127.0.0.1:9", "--camera-retries", "2",
                 "--camera-retry-max", "0.1", "--drain-timeout", "0.1"])
    assert code == 1


def write_png(path, value: int) -> None:
    from PIL import Image

    tmp = path.with_name("." + path.name)  # a capture tool writes, then renames
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(tmp, format="PNG")
    tmp.rename(path)


@pytest.mark.parametrize("after", ["delete", "archive", "keep"])
def test_a_followed_folder_is_read_as_it_fills(tmp_path, after):
    folder, archive = tmp_path / "in", tmp_path / "sent"
    folder.mkdir()
    write_png(folder / "img-000.png", 10)  # there before the device starts
    images = ImageFolder(folder, (3, 4, 4), limit=5, follow=True, after_send=after,
                         archive=archive if after == "archive" else None, fps=10)

    def capture():
        for i in range(1, 5):
            time.sleep(0.1)
            write_png(folder / f"img-{i:03d}.png", 10 * (i + 1))

    writer = threading.Thread(target=capture)
    writer.start()
    got = []
    watchdog = threading.Timer(30, images.stop_event.set)
    watchdog.start()
    for frame, image in images:
        got.append((frame, round(float(image[0, 0, 0]) * 255)))
    watchdog.cancel()
    writer.join()
    assert [v for _, v in got] == [10, 20, 30, 40, 50], "every image once, in name order"
    ids = [f for f, _ in got]
    assert ids == sorted(ids) and len(set(ids)) == 5
    left = sorted(p.name for p in folder.iterdir())
    if after == "keep":
        assert len(left) == 5
    else:
        # The last image is disposed of when the next frame is asked for (it was sent).
        assert left in ([], ["img-004.png"])
    if after == "archive":
        assert len(list(archive.iterdir())) + len(left) == 5


def test_a_followed_folder_skips_unreadable_and_older_names(tmp_path):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "b.png").write_bytes(b"not a png")
    images = ImageFolder(folder, (3, 4, 4), limit=1, follow=True, after_send="keep")
    it = iter(images)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("first", next(it)))
    t.start()
    wait_for(lambda: images.skipped == 1, what="the unreadable b.png taken")
    write_png(folder / "a.png", 1)  # named before what was taken: skipped
    write_png(folder / "c.png", 2)
    t.join(30)
    assert round(float(result["first"][1][0, 0, 0]) * 255) == 2
    assert images.skipped == 1




def test_a_decompression_bomb_is_refused_like_an_unreadable_image(tmp_path):
    """A PNG whose header claims 10^10 pixels: refused before anything is decoded."""
    import struct
    import zlib

    from ddnn.device.sources import read_image
    from ddnn.errors import ConfigError

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    header = struct.pack(">IIBBBBB", 100_000, 100_000, 8, 0, 0, 0, 0)
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b""))
    with pytest.raises(ConfigError, match="not a readable image"):
        read_image(bomb)


def test_a_replay_numbers_frames_by_their_index_in_the_file(tmp_path):
    rng = np.random.default_rng(0)
    X = rng.random((6, 2, 3, 16, 16), dtype=np.float32)
    y = np.ones((6, 2), dtype=np.int64)
    y[3, 1] = -1  # absent by label, though its image is not blank: replayed as all zero
    np.savez(tmp_path / "d.npz", X=X, y=y)
    frames = list(NpzReplay(tmp_path / "d.npz", 1, start=2, limit=3))
    assert [i for i, _ in frames] == [2, 3, 4]
    np.testing.assert_array_equal(frames[0][1], X[2, 1])
    assert not frames[1][1].any()
    assert len(NpzReplay(tmp_path / "d.npz", 0, start=4)) == 2
