"""Over-the-air updates: announcements and the compatibility rule (the whole path runs in
``tests/e2e/test_ota.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from ddnn.bundle import load_bundle
from ddnn.errors import BundleError
from ddnn.plumbing.ota import Announcement, bundle_url, compatible


def test_announcement_round_trip_and_refusals():
    ann = Announcement("tiny", "2", "http://cloud:8000/v1/bundles/tiny/2")
    assert Announcement.parse(ann.to_bytes()) == ann
    assert Announcement.parse(b'{"name": "tiny", "version": 3}') == Announcement("tiny", "3")
    for bad in (b"", b"not json", b"[]", b'{"name": "tiny"}', b'{"name": "Bad/Name", '
                b'"version": "1"}', b'{"name": "tiny", "version": "1", "url": "file:///etc"}'):
        with pytest.raises(BundleError):
            Announcement.parse(bad)
    assert bundle_url("http://c:1/", "tiny", "2") == "http://c:1/v1/bundles/tiny/2"


def test_only_a_compatible_bundle_replaces_the_running_one(tiny_bundle):
    m = load_bundle(tiny_bundle).manifest
    compatible(m, dataclasses.replace(m, version="2"))
    for change in ({"name": "other"}, {"classes": ("a", "b")},
                   {"codec": {**m.codec, "device_features": "int8"}}):
        with pytest.raises(BundleError, match="incompatible update"):
            compatible(m, dataclasses.replace(m, **change))
