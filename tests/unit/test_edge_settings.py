"""``ddnn edge`` settings: flags over ``DDNN_EDGE_*`` over defaults, validated, secrets masked."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ddnn.edge.cli import settings_from
from ddnn.edge.settings import OPTIONS, EdgeSettings
from ddnn.errors import ConfigError
from ddnn.plumbing.options import add_options


def parse(*argv: str, environ: dict[str, str] | None = None) -> EdgeSettings:
    parser = argparse.ArgumentParser()
    add_options(parser, OPTIONS, EdgeSettings, "DDNN_EDGE_")
    return settings_from(parser.parse_args(argv), environ or {})


def test_flags_win_over_variables_which_win_over_defaults():
    s = parse("--bundle", "b", "--deadline-ms", "50", environ={
        "DDNN_EDGE_BROKER": "mqtt://127.0.0.1:1883", "DDNN_EDGE_DEADLINE_MS": "900",
        "DDNN_EDGE_DEVICES": "left, right", "DDNN_EDGE_EDGE_THRESHOLD": "0.25"})
    assert s.bundle == Path("b") and s.broker == "mqtt://127.0.0.1:1883"
    assert s.deadline_ms == 50.0 and s.deadline == 0.05
    assert s.devices == ("left", "right") and s.edge_threshold == 0.25
    assert s.feature_deadline_ms == 500.0 and s.cloud_batch == 32 and s.local_threshold is None


def test_the_bundle_is_required_and_bad_values_name_their_source():
    with pytest.raises(ConfigError, match="--bundle"):
        parse(environ={"DDNN_EDGE_HTTP_PORT": "0"})
    with pytest.raises(ConfigError, match="DDNN_EDGE_CLOUD_BATCH"):
        parse("--bundle", "b", "--http-port", "0", environ={"DDNN_EDGE_CLOUD_BATCH": "many"})


@pytest.mark.parametrize(("change", "match"), [
    ({"broker": None}, "give --broker, or --http-port"),
    ({"broker": "ftp://host"}, "scheme must be"),
    ({"deployment": "Site A"}, "invalid deployment"),
    ({"edge_id": "edge/0"}, "invalid edge id"),
    ({"devices": ("cam0", "cam0")}, "twice"),
    ({"devices": ("Cam0",)}, "invalid device id"),
    ({"deadline_ms": 0}, "deadline_ms must be positive"),
    ({"cloud_batch": 0}, "cloud_batch must be at least 1"),
    ({"local_threshold": 1.5}, r"must lie in \[0, 1\]"),
    ({"http_port": 70000}, "http_port"),
    ({"expect_frames": 0}, "expect_frames"),
    ({"http_token": " "}, "http_token must not be empty"),
    ({"http_token": "t", "http_tokens": Path("f"), "http_port": 0}, "not both"),
    ({"http_tokens": Path("f")}, "--http-tokens needs --http-port"),
    ({"http_max_connections": 0}, "http_max_connections must be at least 1"),
    ({"http_cert_file": Path("c"), "http_port": 0}, "--http-cert-file and --http-key-file "
                                                    "together"),
    ({"http_cert_file": Path("c"), "http_key_file": Path("k")}, "need --http-port"),
    ({"http_cert_file": Path("c"), "http_key_file": Path("k"), "http_port": 0},
     "certificate or key c: no such file"),
])
def test_bad_settings_are_refused(change, match):
    with pytest.raises(ConfigError, match=match):
        EdgeSettings(**{"bundle": Path("b"), "broker": "mqtt://127.0.0.1", **change})


def test_the_start_up_description_masks_every_secret():
    s = EdgeSettings(bundle=Path("b"), broker="mqtt://edge:hunter2@broker:1883",
                     password="pw1", cloud_token="tok2", http_token="tok3",
                     results_token="tok4")
    text = str(s.describe())
    assert "edge@broker:1883" in text
    assert not any(secret in text for secret in ("hunter2", "pw1", "tok2", "tok3", "tok4"))


def test_every_field_is_an_option():
    fields = set(EdgeSettings.__dataclass_fields__)
    assert {o.field for o in OPTIONS} == fields
