"""The command of a running role (``ddnn device``, ``gateway``, ``edge``, ``cloud``), written once.

Each role is one :class:`Role`: its name, its help, its options table and settings class
(:mod:`ddnn.plumbing.options`), its variables' prefix and what it runs. The role's module
(``device/cli.py``, ...) says what is its own (the description and the body of ``run``) and
publishes ``register = ROLE.register`` (what ``ddnn.cli`` calls) and
``settings_from = ROLE.settings_from``. Every flag also reads ``{prefix}<OPTION>``; a flag
given on the command line wins over the variable, which wins over the default.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ddnn.plumbing import options
from ddnn.plumbing.options import Option


@dataclass(frozen=True, kw_only=True)
class Role:
    """One running role as a subcommand: parsed, resolved into settings, run."""

    name: str  # the subcommand: "device"
    help: str  # its line in `ddnn --help`
    description: str  # its `ddnn NAME --help` text, before the sentence on variables
    options: tuple[Option, ...]
    settings: type  # the frozen settings dataclass the options fill
    env_prefix: str  # "DDNN_DEVICE_"
    run: Callable[[Any], int]  # settings -> exit code; imports what it runs when called
    example: str = ""  # a variable as the description shows it, e.g. "BROKER=mqtt://b:1883"

    @property
    def epilogue(self) -> str:
        """The sentence every role's description ends with: how variables stand in for flags."""
        e = f" (e.g. {self.env_prefix}{self.example})" if self.example else ""
        return textwrap.fill(f"Every option also reads the environment variable "
                             f"{self.env_prefix}<OPTION>{e}; a flag wins over the variable.", 95)

    def register(self, sub, data_sub, formatter) -> None:
        """Add the role's subcommand to ``ddnn``'s (``data_sub``: unused, no data actions)."""
        p = sub.add_parser(self.name, help=self.help, formatter_class=formatter,
                           description=f"{self.description}\n{self.epilogue}")
        options.add_options(p, self.options, self.settings, self.env_prefix)
        p.set_defaults(func=self.run_args)

    def settings_from(self, args: argparse.Namespace | None,
                      environ: Mapping[str, str] | None = None) -> Any:
        """Resolve flags over ``{env_prefix}*`` variables over defaults into settings."""
        return options.settings_from(args, self.options, self.settings, self.env_prefix,
                                     environ)

    def run_args(self, args: argparse.Namespace) -> int:
        """Run the role on parsed arguments (and the process's environment)."""
        return self.run(self.settings_from(args))
