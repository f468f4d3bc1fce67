"""Per-device HTTP tokens (``ddnn edge --http-tokens``): the file and the constant-time lookup."""

from __future__ import annotations

import logging

import pytest

from ddnn.edge.credentials import ANY_DEVICE, HttpCredentials, load_http_tokens
from ddnn.errors import ConfigError

DEVICES = ("cam0", "cam1", "cam2")


def write(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "tokens"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_one_line_per_device_comments_and_blanks_skipped(tmp_path, caplog):
    path = write(tmp_path, "# cameras\n\ncam0  aaaaaaaaaaaaaaaa\n\tcam2 bbbbbbbbbbbbbbbb  \n")
    with caplog.at_level(logging.WARNING):
        assert load_http_tokens(path, DEVICES) == {"cam0": "a" * 16, "cam2": "b" * 16}
    assert not caplog.records  # mode 0600: nothing to say


def test_a_file_others_can_read_is_taken_with_a_warning(tmp_path, caplog):
    path = write(tmp_path, "cam0 aaaaaaaaaaaaaaaa\n", mode=0o644)
    with caplog.at_level(logging.WARNING):
        load_http_tokens(path, DEVICES)
    assert "chmod 600" in caplog.text and "aaaa" not in caplog.text


@pytest.mark.parametrize(("text", "match"), [
    ("cam0\n", "line 1: expected 'DEVICE_ID TOKEN'"),
    ("cam0 secret-token-0123456789 extra\n", "line 1: expected 'DEVICE_ID TOKEN'"),
    ("cam0 t1ny\n", "token of 'cam0' is shorter than 16"),
    ("cam7 cam7-token-0123456789\n", "'cam7' is not one of this edge's devices"),
    ("secret-Token-0123456789 cam0\n", "line 1: the first field is not a device id"),
    ("cam0 cam0-token-0123456789\ncam0 cam0-token-9876543210\n", "line 2: .*listed twice"),
    ("cam0 same-token-0123456789\ncam1 same-token-0123456789\n", "token of another device"),
    ("# nothing\n\n", "no 'DEVICE_ID TOKEN' line"),
])
def test_a_bad_file_is_refused_without_showing_a_token(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_http_tokens(write(tmp_path, text), DEVICES)
    for secret in ("token-0123456789", "token-9876543210", "t1ny", "Token"):
        assert secret not in str(e.value)


def test_an_unreadable_or_binary_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it"):
        load_http_tokens(tmp_path / "missing", DEVICES)
    path = tmp_path / "binary"
    path.write_bytes(b"cam0 \xff\xfe-not-utf8-token\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_http_tokens(path, DEVICES)


def test_each_token_speaks_for_its_device_only():
    creds = HttpCredentials(devices={"cam0": "a" * 16, "cam1": "b" * 16})
    assert creds.identify(b"Bearer " + b"a" * 16) == "cam0"
    assert creds.identify(b"Bearer " + b"b" * 16) == "cam1"
    assert creds.identify(b"Bearer " + b"c" * 16) is None
    assert creds.identify(b"") is None
    assert creds.identify(b"a" * 16) is None  # the scheme is part of it
    assert "a" * 16 not in repr(creds)


def test_the_shared_token_or_none_speaks_for_every_device(caplog):
    with caplog.at_level(logging.WARNING):
        shared = HttpCredentials("s3cret")
    assert "may post as any device" in caplog.text and "s3cret" not in caplog.text
    assert shared.identify(b"Bearer s3cret") == ANY_DEVICE
    assert HttpCredentials("s3cret").identify(b"Bearer other") is None
    assert HttpCredentials().identify(b"") == ANY_DEVICE
