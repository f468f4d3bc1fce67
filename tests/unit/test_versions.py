"""The one version order (ddnn/versions.py): the cloud, over-the-air updates and training agree."""

from __future__ import annotations

import itertools

import pytest

from ddnn.errors import ConfigError
from ddnn.versions import is_newer, next_version, version_key

ORDERED = ["alpha", "beta", "v2", "0", "1", "1.0.1", "1.2", "1.9", "1.10", "2", "9", "10",
           "10.0.1"]


def test_sorting_follows_the_documented_order():
    shuffled = ORDERED[::-1][3:] + ORDERED[::-1][:3]
    assert sorted(shuffled, key=version_key) == ORDERED


def test_trailing_zeros_name_the_same_version():
    assert version_key("1.0") == version_key("1") == version_key("1.0.0")
    assert not is_newer("1.0", "1") and not is_newer("1", "1.0")


@pytest.mark.parametrize(("a", "b"), list(itertools.pairwise(ORDERED[3:])))
def test_newer_agrees_with_the_sort_key_on_numeric_versions(a, b):
    assert is_newer(b, a) and not is_newer(a, b)
    assert version_key(b) > version_key(a)


@pytest.mark.parametrize(("version", "after"), [("1", "2"), ("9", "10"), ("1.9", "1.10"),
                                                ("2.0.3", "2.0.4"), ("007", "8")])
def test_next_version_is_the_next_in_the_order(version, after):
    assert next_version(version) == after
    assert is_newer(next_version(version), version)


def test_a_version_that_is_not_numeric_has_no_next():
    with pytest.raises(ConfigError, match="not numeric"):
        next_version("beta")
