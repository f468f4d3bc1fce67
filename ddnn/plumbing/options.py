"""One table of options per tier: flag, environment variable, default, help — written once.

A tier lists its options as :class:`Option` rows beside a frozen ``*Settings`` dataclass whose
field defaults are the defaults. :func:`add_options` turns the table into argparse flags (help
text names the variable and the default); :func:`settings_from` resolves flag over
``DDNN_<TIER>_<NAME>`` over default into the settings object, which validates itself;
:func:`markdown_table` renders the table for the docs, which a test keeps in step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddnn.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def boolean(value: str) -> bool:
    """``true``/``false`` (also 1/0, yes/no, on/off) from a flag or variable."""
    v = value.strip().lower()
    if v not in _TRUE | _FALSE:
        raise ConfigError(f"expected a boolean (true/false), got {value!r}")
    return v in _TRUE


def optional_int(value: str) -> int | None:
    """An integer, or ``none``/``auto``/empty for "let the library choose"."""
    return None if value.strip().lower() in ("", "none", "auto") else int(value)


def id_list(value: str) -> tuple[str, ...]:
    """A comma-separated list (``cam0,cam1``), blanks removed."""
    return tuple(p.strip() for p in value.split(",") if p.strip())


@dataclass(frozen=True)
class Option:
    """One row of a tier's options table."""

    name: str  # the flag without dashes: "max-batch-size" (field max_batch_size)
    parse: Callable[[str], Any]  # from the flag's or variable's text to the field's value
    metavar: str
    help: str
    secret: bool = False  # never shown: not in help defaults, masked in the start-up log
    choices: tuple[str, ...] | None = None
    group: str | None = None  # mutually exclusive group (e.g. the frame sources)

    @property
    def field(self) -> str:
        return self.name.replace("-", "_")

    def env(self, prefix: str) -> str:
        return prefix + self.field.upper()


def _default(settings_cls: type, option: Option) -> Any:
    f = settings_cls.__dataclass_fields__[option.field]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None  # required: no default


def _required(settings_cls: type, option: Option) -> bool:
    f = settings_cls.__dataclass_fields__[option.field]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _shown(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, tuple | list):
        return ",".join(map(str, value)) or "unset"
    return str(value)


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option], settings_cls: type,
                prefix: str) -> None:
    """Add one flag per option; an absent flag leaves no attribute (the variable applies)."""
    groups: dict[str, Any] = {}
    for o in options:
        target = parser
        if o.group:
            if o.group not in groups:  # one argparse group per name (not one per row)
                groups[o.group] = parser.add_mutually_exclusive_group()
            target = groups[o.group]
        default = "hidden" if o.secret else _shown(_default(settings_cls, o))
        need = "required; " if _required(settings_cls, o) else ""
        # %% because argparse formats help strings with %.
        text = f"{o.help} (env {o.env(prefix)}; {need}default: {default})".replace("%", "%%")
        # A boolean flag given alone means true: `--follow` is `--follow true`.
        alone = {"nargs": "?", "const": "true"} if o.parse is boolean else {}
        target.add_argument(f"--{o.name}", default=argparse.SUPPRESS, metavar=o.metavar,
                            choices=o.choices, help=text, **alone)


def settings_from(args: argparse.Namespace | None, options: Iterable[Option], settings_cls: type,
                  prefix: str, environ: Mapping[str, str] | None = None, **fixed: Any) -> Any:
    """Flags over ``{prefix}*`` variables over defaults, parsed and validated into settings.

    ``fixed`` values (from code, e.g. tests) win over both.
    """
    environ = os.environ if environ is None else environ
    options = tuple(options)
    given = {o.field: getattr(args, o.field, None) if args is not None else None for o in options}
    # A flag of a mutually exclusive group overrides the variables of the whole group.
    flagged = {o.group for o in options if o.group and given[o.field] is not None}
    values: dict[str, Any] = {}
    for o in options:
        raw, source = given[o.field], f"--{o.name}"
        if raw is None and o.group in flagged:
            continue
        if raw is None:
            raw, source = environ.get(o.env(prefix)), o.env(prefix)
        if raw is None:
            continue
        if o.choices and raw not in o.choices:
            raise ConfigError(f"{source}: {raw!r} is not one of {', '.join(o.choices)}")
        try:
            values[o.field] = o.parse(raw)
        except (ValueError, TypeError, ConfigError) as e:
            shown = "***" if o.secret else repr(raw)
            raise ConfigError(f"{source}: invalid value {shown} ({e})") from None
    values.update(fixed)
    missing = [o for o in options if _required(settings_cls, o) and o.field not in values]
    if missing:
        o = missing[0]
        raise ConfigError(f"--{o.name} (or {o.env(prefix)}) is required")
    return settings_cls(**values)


def describe(settings: Any, options: Iterable[Option]) -> dict[str, Any]:
    """The resolved settings for the start-up log: secrets masked, paths as text."""
    secret = {o.field for o in options if o.secret}
    out = {}
    for f in dataclasses.fields(settings):
        v = getattr(settings, f.name)
        if f.name in secret and v is not None:
            v = "***"
        elif isinstance(v, Path):
            v = str(v)
        elif isinstance(v, str) and "@" in v:
            v = _without_credentials(v)
        out[f.name] = v
    return out


def _without_credentials(url: str) -> str:
    """``scheme://user:pass@host`` -> ``scheme://user:***@host``; other text unchanged."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def markdown_table(options: Iterable[Option], settings_cls: type, prefix: str) -> str:
    """The options as a Markdown table (flag, variable, default, meaning) for the docs."""
    rows = ["| option | environment variable | default | meaning |", "|---|---|---|---|"]
    for o in options:
        default = "(hidden)" if o.secret else _shown(_default(settings_cls, o))
        if _required(settings_cls, o):
            default = "required"
        meaning = o.help.replace("|", "\\|")
        if o.choices:
            meaning += f" (one of: {', '.join(o.choices)})"
        rows.append(f"| `--{o.name} {o.metavar}` | `{o.env(prefix)}` | `{default}` | {meaning} |")
    return "\n".join(rows) + "\n"


def path(value: str) -> Path:
    """A filesystem path from a flag or variable."""
    return Path(value)
