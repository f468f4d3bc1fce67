"""Over-the-air update policy: which versions count as newer, which URLs share an origin, and
how many JSON arrays an inference body may hold (the hostile cases run against real servers in
tests/integration/test_hostile_ota.py and test_hostile_cloud.py)."""

from __future__ import annotations

import pytest

from ddnn import oip
from ddnn.errors import BundleError
from ddnn.plumbing.ota import Announcement, Origin
from ddnn.versions import is_newer, parse_version


@pytest.mark.parametrize(("new", "running", "newer"), [
    ("2", "1", True), ("10", "9", True), ("1.10", "1.9", True), ("1.0.1", "1", True),
    ("1", "1", False), ("1.0", "1", False), ("1", "1.0", False), ("9", "10", False),
    ("1.9", "1.10", False), ("0", "1", False),
    # What cannot be ordered is never newer: refused unless downgrades are allowed.
    ("beta", "1", False), ("2", "beta", False), ("2024-05", "1", False), ("1.", "1", False),
    ("v2", "v1", False),
])
def test_versions_go_forward_numerically(new, running, newer):
    assert is_newer(new, running) is newer


def test_version_parsing():
    assert parse_version("1.10.2") == (1, 10, 2)
    assert parse_version("007") == (7,)
    for bad in ("", "1..2", "-1", "1.x", " 1", "1e3"):
        assert parse_version(bad) is None


def test_origins():
    assert Origin.of("http://Cloud:80/x") == Origin.of("http://cloud/v1/bundles")
    assert Origin.of("https://cloud/x") == Origin("https", "cloud", 443)
    assert Origin.of("http://cloud:8000/a") != Origin.of("http://cloud:8001/a")
    assert Origin.of("http://cloud/a") != Origin.of("https://cloud/a")
    assert str(Origin.of("http://[::1]:8000/")) == "http://[::1]:8000"
    for bad in ("file:///etc/passwd", "ftp://cloud/x", "http:///x", "http://u:p@cloud/x",
                "http://cloud:99999/x", "cloud:8000"):
        with pytest.raises(BundleError):
            Origin.of(bad)


def test_announcements_with_bad_urls_are_unreadable():
    for url in ("http://u:p@cloud/x", "http://cloud:notaport/x", 5):
        payload = Announcement("tiny", "2").to_bytes()[:-1] + f', "url": {url!r}}}'.replace(
            "'", '"').encode()
        with pytest.raises(BundleError):
            Announcement.parse(payload)


def test_json_array_limit_covers_nested_tensors_and_refuses_bombs():
    shapes = [("FP32", (16, 4, 4))]
    x = [[[[1] * 4] * 4] * 16] * 8  # 8 samples, nested as the shape says, the shortest values
    body = str(x).replace(" ", "").encode()
    assert body.count(b"[") <= oip.json_array_limit(shapes, len(body))
    bomb = b"[" + b"[]," * 100_000 + b"[]]"
    assert bomb.count(b"[") > oip.json_array_limit(shapes, len(bomb))
    flat = [("BOOL", (3,)), ("FP32", (3, 3, 16, 16))]
    assert oip.json_array_limit(flat, 1000) < oip.json_array_limit(flat, 100_000)


def test_decode_request_counts_arrays_before_parsing():
    head = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ['
    body = head + b"[]," * 1000 + b"[]]}]}"
    with pytest.raises(oip.OipError, match="holds 1004 arrays"):
        oip.decode_request(body, {}, max_json_arrays=100)
    with pytest.raises(oip.OipError, match="holds 1001 values"):  # without the bound
        oip.decode_request(body, {})
    with pytest.raises(oip.OipError, match="exceeds the limit"):
        oip.decode_request(b'{"inputs": [{"name": "x", "datatype": "FP32", '
                           b'"shape": [1000000000000000000000000000000, 0], "data": []}]}', {})
