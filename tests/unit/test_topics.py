"""The topic contract: lowercase levels, one deployment's tree, parsing what devices publish."""

import pytest

from ddnn.errors import ConfigError
from ddnn.topics import Topics, check_part, default_device_ids


def test_topics_of_a_deployment():
    t = Topics("yard")
    assert t.device("cam0", "scores") == "ddnn/yard/devices/cam0/scores"
    assert t.all_devices("status") == "ddnn/yard/devices/+/status"
    assert t.requests("edge0") == "ddnn/yard/edges/edge0/requests"
    assert (t.results, t.bundle) == ("ddnn/yard/results", "ddnn/yard/bundle")
    assert Topics("yard", prefix="site/a").results == "site/a/yard/results"


@pytest.mark.parametrize("bad", ["", "Cam0", "cam/0", "cam+", "#", "-cam", "a" * 65, "cäm"])
def test_invalid_levels_are_refused(bad):
    with pytest.raises(ConfigError, match="lowercase letters"):
        check_part("device id", bad)


def test_parse_device_accepts_only_this_deployments_device_topics():
    t = Topics("yard")
    assert t.parse_device("ddnn/yard/devices/cam3/features") == ("cam3", "features")
    for topic in ("ddnn/other/devices/cam3/scores", "ddnn/yard/devices/Cam3/scores",
                  "ddnn/yard/devices/cam3/secrets", "ddnn/yard/devices/cam3/scores/x"):
        assert t.parse_device(topic) is None
    assert default_device_ids(3) == ["cam0", "cam1", "cam2"]
