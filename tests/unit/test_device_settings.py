"""The device's settings: flags over ``DDNN_DEVICE_*`` over defaults, validated once."""

import argparse
import logging

import pytest

from ddnn.device.cli import settings_from
from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.errors import ConfigError


@pytest.fixture
def env(tmp_path):
    (tmp_path / "bundle").mkdir()
    return {"DDNN_DEVICE_BUNDLE": str(tmp_path / "bundle"), "DDNN_DEVICE_VIEW": "1",
            "DDNN_DEVICE_BROKER": "mqtt://cam1:s3cret@broker:1883",
            "DDNN_DEVICE_DATA": "test.npz", "DDNN_DEVICE_PASSWORD": "hunter2"}


def test_flags_over_environment_over_defaults(env):
    s = settings_from(argparse.Namespace(fps="2.5", peers="cam0, cam2"),
                      {**env, "DDNN_DEVICE_FPS": "5", "DDNN_DEVICE_MODE": "push"})
    assert (s.view, s.fps, s.mode, s.peers) == (1, 2.5, "push", ("cam0", "cam2"))
    assert (s.device_id, s.deployment, s.edge_id, s.buffer, s.keep) == (
        "cam1", "default", "edge0", 10_000, 1024)


def test_a_source_flag_overrides_the_source_variables(env):
    s = settings_from(argparse.Namespace(camera="0"), env)
    assert (s.camera, s.data) == (0, None)
    with pytest.raises(ConfigError, match="exactly one frame source"):
        settings_from(argparse.Namespace(), {**env, "DDNN_DEVICE_IMAGES": "imgs"})
    with pytest.raises(ConfigError, match="exactly one frame source"):
        settings_from(argparse.Namespace(), {k: v for k, v in env.items() if "DATA" not in k})


@pytest.mark.parametrize(("change", "why"), [
    ({"DDNN_DEVICE_VIEW": "-1"}, "view must not be negative"),
    ({"DDNN_DEVICE_DEVICE_ID": "Cam1"}, "invalid device id"),
    ({"DDNN_DEVICE_DEPLOYMENT": "a/b"}, "invalid deployment"),
    ({"DDNN_DEVICE_PEERS": "cam0,+"}, "invalid peer device id"),
    ({"DDNN_DEVICE_MODE": "both"}, "not one of pull, push"),
    ({"DDNN_DEVICE_BROKER": ""}, "give --broker"),
    ({"DDNN_DEVICE_BROKER": "http://broker"}, "scheme must be mqtt"),
    ({"DDNN_DEVICE_BUFFER": "0"}, "buffer must be at least 1"),
    ({"DDNN_DEVICE_FPS": "-1"}, "fps must be at least 0"),
    ({"DDNN_DEVICE_KEEPALIVE": "70000"}, "keepalive must be at most"),
    ({"DDNN_DEVICE_LOCAL_THRESHOLD": "1.5"}, "local_threshold must be in 0..1"),
    ({"DDNN_DEVICE_LIMIT": "-3"}, "limit must not be negative"),
    ({"DDNN_DEVICE_TOKEN": " "}, "token must not be empty"),
    ({"DDNN_DEVICE_BUNDLE": "/nonexistent"}, "no such directory"),
    ({"DDNN_DEVICE_VIEW": "one"}, "DDNN_DEVICE_VIEW: invalid value"),
    ({"DDNN_DEVICE_SPOOL": "/s", "DDNN_DEVICE_NO_SPOOL": "true"}, "exclude each other"),
    # Options of the HTTP path that would be ignored are refused.
    ({"DDNN_DEVICE_TOKEN": "t0ken"}, "--token: used on the HTTP path only, which needs "
                                     "--edge-url"),
    ({"DDNN_DEVICE_EDGE_CA_FILE": "/ca.crt"}, "--edge-ca-file: used on the HTTP path only"),
    ({"DDNN_DEVICE_EDGE_URL": "http://edge:9100", "DDNN_DEVICE_EDGE_CA_FILE": "/ca.crt"},
     "--edge-ca-file needs an https:// --edge-url"),
    ({"DDNN_DEVICE_EDGE_URL": "https://edge:9100", "DDNN_DEVICE_EDGE_CA_FILE": "/ca.crt"},
     "edge CA file /ca.crt: no such file"),
    ({"DDNN_DEVICE_EDGE_URL": "edge:9100"}, "must be http\\(s\\)://host"),
    ({"DDNN_DEVICE_FAILOVER_AFTER": "0"}, "failover_after must be at least 0.1"),
])
def test_bad_settings_are_refused_with_the_reason(env, change, why):
    with pytest.raises(ConfigError, match=why):
        settings_from(argparse.Namespace(), {**env, **change})


def test_bundle_and_view_are_required(env):
    with pytest.raises(ConfigError, match="--view .* is required"):
        settings_from(argparse.Namespace(), {k: v for k, v in env.items() if "VIEW" not in k})


def test_describe_masks_every_secret(env):
    shown = settings_from(argparse.Namespace(token="tok", edge_url="http://edge:9100"),
                          env).describe()
    assert shown["password"] == "***" and shown["token"] == "***"
    assert shown["broker"] == "mqtt://cam1@broker:1883"
    assert "s3cret" not in repr(shown) and "hunter2" not in repr(shown)


def test_from_settings_checks_the_view_and_resolves_for_the_bundle(tiny_bundle, tiny_data,
                                                                   device_state, caplog):
    base = dict(bundle=tiny_bundle, data=tiny_data.test, edge_url="http://127.0.0.1:9")
    with pytest.raises(ConfigError, match="outside the bundle's views 0..2"):
        DeviceService.from_settings(DeviceSettings(view=3, **base))
    with caplog.at_level(logging.INFO, logger="ddnn.device.service"):
        service = DeviceService.from_settings(DeviceSettings(view=2, token="tok", **base))
    assert "device config: bundle tiny:1" in caplog.text and "'token': '***'" in caplog.text
    s = service.settings
    # The HTTP fallback has no pull channel; peers default to every view.
    assert (s.mode, s.peers, s.device_id) == ("push", ("cam0", "cam1", "cam2"), "cam2")
    assert service.agent.settings is s and len(service.source) == 120
    # Durable by default: the spool is in the state directory, per deployment and device.
    assert s.spool == device_state / "ddnn" / "spool" / "default" / "cam2"
    assert service.outbox.spooled
    off = DeviceService.from_settings(DeviceSettings(view=2, no_spool=True, **base))
    assert off.settings.spool is None and not off.outbox.spooled


def test_over_the_air_options(env):
    s = settings_from(argparse.Namespace(), {**env, "DDNN_DEVICE_OTA_ORIGIN": "https://cloud:8000",
                                             "DDNN_DEVICE_OTA_ALLOW_DOWNGRADE": "true"})
    assert (s.ota_origin, s.ota_allow_downgrade, s.ota_allow_unsigned) == (
        "https://cloud:8000", True, False)
    for bad in ("ftp://cloud", "cloud:8000", "https://"):
        with pytest.raises(ConfigError, match="--ota-origin"):
            settings_from(argparse.Namespace(), {**env, "DDNN_DEVICE_OTA_ORIGIN": bad})


def test_an_over_the_air_token_goes_only_with_its_origin(env):
    s = settings_from(argparse.Namespace(), {**env, "DDNN_DEVICE_OTA_ORIGIN": "https://c:8000",
                                             "DDNN_DEVICE_OTA_TOKEN": "t0ken-for-bundles"})
    assert s.ota_token == "t0ken-for-bundles" and s.describe()["ota_token"] == "***"
    with pytest.raises(ConfigError, match="need --ota-origin"):
        settings_from(argparse.Namespace(), {**env, "DDNN_DEVICE_OTA_TOKEN": "t0ken"})


def test_options_are_grouped_by_concern_in_code_and_in_help(env, capsys):
    from ddnn.cli import build_parser
    from ddnn.device.settings import OPTIONS, FrameSource, OutboxPolicy

    s = settings_from(argparse.Namespace(fps="5", buffer="7"), env)
    assert isinstance(s.source, FrameSource) and s.source.fps == s.fps == 5.0
    assert isinstance(s.outbox, OutboxPolicy) and s.outbox.buffer == s.buffer == 7
    assert all(o.section for o in OPTIONS), "every row is listed under a heading"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["device", "--help"])
    text = capsys.readouterr().out
    headings = [o.section for o in OPTIONS]
    at = [text.index(f"\n{h}:\n") for h in dict.fromkeys(headings)]
    assert at == sorted(at), "headings in the table's order"
    frames = text.index("\nFrame source")
    assert frames < text.index("  --camera INDEX") < text.index("\nMQTT uplink:")
