"""The one scaffold of the running roles' commands (ddnn.plumbing.role_cli)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from ddnn.errors import ConfigError
from ddnn.plumbing.options import Option
from ddnn.plumbing.role_cli import Role


@dataclass(frozen=True)
class _Settings:
    broker: str
    port: int = 8000


_OPTIONS = (Option("broker", str, "URL", "the broker"), Option("port", int, "N", "a port"))


def _role(run, **more) -> Role:
    return Role(name="thing", help="run a thing", description="Run a thing.", options=_OPTIONS,
                settings=_Settings, env_prefix="DDNN_THING_", run=run, **more)


def _parser(role: Role) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddnn")
    role.register(parser.add_subparsers(dest="command"), None, argparse.HelpFormatter)
    return parser


def test_a_role_runs_on_flags_over_variables_over_defaults(monkeypatch):
    ran = []
    role = _role(lambda s: ran.append(s) or 3, example="PORT=9")
    monkeypatch.setenv("DDNN_THING_BROKER", "mqtt://env")
    monkeypatch.setenv("DDNN_THING_PORT", "7")
    args = _parser(role).parse_args(["thing", "--port", "9"])
    assert args.func(args) == 3
    assert ran == [_Settings("mqtt://env", 9)]
    assert role.settings_from(argparse.Namespace(), {"DDNN_THING_BROKER": "b"}) == _Settings("b")


def test_a_role_says_how_variables_stand_in_for_flags(capsys):
    role = _role(lambda s: 0, example="PORT=9")
    with pytest.raises(SystemExit):
        _parser(role).parse_args(["thing", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Run a thing. Every option also reads the environment variable DDNN_THING_<OPTION> " \
           "(e.g. DDNN_THING_PORT=9); a flag wins over the variable." in text
    assert "(env DDNN_THING_BROKER; required; default: unset)" in text


def test_a_required_option_missing_everywhere_is_a_config_error():
    role = _role(lambda s: 0)
    with pytest.raises(ConfigError, match="--broker .or DDNN_THING_BROKER. is required"):
        role.settings_from(argparse.Namespace(), {})
