"""The device's outbox (bounded, drop-oldest, on-disk spool) and its image sources."""

import zlib

import numpy as np

from ddnn.device.buffer import Outbox
from ddnn.device.message import OutMessage
from ddnn.device.sources import ImageFolder, is_absent, read_image


def test_full_outbox_drops_the_oldest_and_counts():
    box = Outbox(capacity=2)
    for i in range(3):
        box.put(OutMessage("scores", bytes([i]), i))
    assert box.dropped == 1 and len(box) == 2
    assert box.peek(0).frame == 1
    box.pop()
    assert box.peek(0).frame == 2


def test_spool_survives_a_restart(tmp_path):
    box = Outbox(capacity=10, spool=tmp_path)
    box.put(OutMessage("scores", b"abc", 7))
    box.put(OutMessage("features", b"\x00\x01", 8))
    box.pop()  # handed to the transport: gone from disk too
    again = Outbox(capacity=10, spool=tmp_path)
    assert len(again) == 1
    assert again.peek(0) == OutMessage("features", b"\x00\x01", 8)


def _png(img: np.ndarray) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body).to_bytes(4, "big")
        return len(body).to_bytes(4, "big") + kind + body + crc

    h, w, _ = img.shape
    # Filter type 1 (Sub) on every row: exercises the byte-by-byte unfiltering.
    rows = []
    for y in range(h):
        line = img[y].astype(np.int16).ravel()
        sub = (line - np.concatenate([np.zeros(3, np.int16), line[:-3]])) & 0xFF
        rows.append(b"\x01" + sub.astype(np.uint8).tobytes())
    header = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b""))


def test_png_and_ppm_are_read(tmp_path):
    img = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    (tmp_path / "a.png").write_bytes(_png(img))
    (tmp_path / "b.ppm").write_bytes(b"P6\n# comment\n7 5\n255\n" + img.tobytes())
    np.testing.assert_array_equal(read_image(tmp_path / "a.png"), img)
    np.testing.assert_array_equal(read_image(tmp_path / "b.ppm"), img)
    frames = list(ImageFolder(tmp_path, (3, 16, 16)))
    assert [i for i, _ in frames] == [0, 1]
    assert frames[0][1].shape == (3, 16, 16) and frames[0][1].max() <= 1.0
    assert is_absent(np.zeros((3, 4, 4))) and not is_absent(frames[0][1])
