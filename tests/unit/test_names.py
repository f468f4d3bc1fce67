"""The one name rule, shared by bundles, topics and message headers."""

import pytest

from ddnn import envelope as env
from ddnn.bundle import check_name as bundle_name
from ddnn.envelope import DecodeError, MessageType
from ddnn.errors import BundleError, CodecError, ConfigError
from ddnn.names import check_name, is_name
from ddnn.topics import check_part


@pytest.mark.parametrize("good", ["cam0", "a", "tiny-v1.2_x", "0", "a" * 64])
def test_valid_names(good):
    assert is_name(good)
    assert check_name("device id", good) == good == check_part("x", good) == bundle_name("x", good)


@pytest.mark.parametrize("bad", ["", "Cam0", "cam0\n", "-x", ".x", "a/b", "a+b", "a" * 65,
                                 "a b", "é", None, 3])
def test_invalid_names_are_refused_everywhere(bad):
    assert not is_name(bad)
    with pytest.raises(ConfigError):
        check_part("device id", bad)
    with pytest.raises(BundleError):
        bundle_name("model name", bad)


def test_a_trailing_newline_is_not_a_name():
    # ``$`` would accept it; the rule uses fullmatch.
    with pytest.raises(ConfigError, match="invalid device id"):
        check_name("device id", "cam0\n")


def test_envelope_refuses_what_the_rule_refuses():
    with pytest.raises(CodecError):
        env.encode(env.pack(MessageType.ABSENT, model="Tiny", version="1", deployment="d",
                            device="cam0", frame=1))
    good = env.encode(env.pack(MessageType.ABSENT, model="tiny", version="1", deployment="d",
                               device="cam0", frame=1))
    bad = good.replace(b"tiny", b"TINY")
    with pytest.raises(DecodeError):
        env.decode(bad)
