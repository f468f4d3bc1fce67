"""One table of options per tier: flag, environment variable, default, help — written once.

A tier lists its options as :class:`Option` rows beside a frozen ``*Settings`` dataclass whose
field defaults are the defaults. :func:`add_options` turns the table into argparse flags (help
text names the variable and the default); :func:`settings_from` resolves flag over
``DDNN_<TIER>_<NAME>`` over default into the settings object, which validates itself;
:func:`markdown_table` renders the table for the docs, which a test keeps in step.

**Option groups.** Options that travel together (MQTT security, over-the-air updates, the
cloud link, the monitoring HTTP server) are a frozen dataclass of their own, validated on its
own and handed whole to the part that uses it. A tier nests the group in one field of its
settings; its rows (:func:`grouped`) keep their flat names, so flags, variables, help and docs
are what they were: ``--cloud-timeout`` and ``DDNN_EDGE_CLOUD_TIMEOUT`` fill
``EdgeSettings.cloud_link.timeout``. :func:`bind` lets code build and read settings by the
flat names too (``EdgeSettings(cloud_timeout=5).cloud_timeout``).

**Sections.** Rows may carry the concern they belong to (:func:`section`): ``--help`` lists
them under it, one heading per section in the order of the table, so a long table reads as a
few short ones.
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
    # In an option group: the settings field holding the group (set by grouped()), and the
    # group's own field this row fills (default: the flat name).
    within: str | None = None
    key: str | None = None
    section: str | None = None  # the heading it is listed under in --help (see section())

    @property
    def dest(self) -> str:
        """The flat name: argparse's attribute, the variable's suffix, the start-up log's key."""
        return self.name.replace("-", "_")

    @property
    def field(self) -> str:
        """The settings field this row fills (the group's field, for a row of a group)."""
        return self.within or self.dest

    @property
    def attr(self) -> str:
        """The field of its group this row fills (its own field, outside a group)."""
        return self.key or self.dest

    def env(self, prefix: str) -> str:
        return prefix + self.dest.upper()


def grouped(field: str, rows: Iterable[Option]) -> tuple[Option, ...]:
    """The rows of an option group whose dataclass a tier holds in its settings ``field``."""
    return tuple(dataclasses.replace(o, within=field) for o in rows)


def section(title: str, rows: Iterable[Option]) -> tuple[Option, ...]:
    """``rows`` under the heading ``title`` in ``--help``."""
    return tuple(dataclasses.replace(o, section=title) for o in rows)


def _field_default(cls: type, name: str) -> Any:
    f = cls.__dataclass_fields__[name]
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None  # required: no default


def _default(settings_cls: type, option: Option) -> Any:
    value = _field_default(settings_cls, option.field)
    return getattr(value, option.attr) if option.within else value


def _required(settings_cls: type, option: Option) -> bool:
    if option.within:
        return False  # a group has a default, and so has each of its fields
    f = settings_cls.__dataclass_fields__[option.field]
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def nest(settings_cls: type, options: Iterable[Option], values: Mapping[str, Any]
         ) -> dict[str, Any]:
    """``values`` by field, the flat names of grouped rows gathered into their groups (each
    validated as it is made, over the group the settings have by default or were given)."""
    rows = {o.dest: o for o in options if o.within}
    out, groups = {}, {}
    for name, value in values.items():
        row = rows.get(name)
        if row is None:
            out[name] = value
        else:
            groups.setdefault(row.within, {})[row.attr] = value
    for field, changes in groups.items():
        base = out.get(field)
        if base is None:
            base = _field_default(settings_cls, field)
        out[field] = dataclasses.replace(base, **changes)
    return out


def bind(settings_cls: type, options: Iterable[Option]) -> None:
    """Let ``settings_cls`` be built with, and read by, the flat names of its grouped options
    too, as code built and read it before its options were grouped."""
    options = tuple(options)
    rows = {o.dest: o for o in options if o.within}
    init = settings_cls.__init__

    def __init__(self, **values: Any) -> None:
        init(self, **nest(settings_cls, options, values))

    def __getattr__(self, name: str) -> Any:
        row = rows.get(name)
        if row is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(getattr(self, row.within), row.attr)

    __init__.__doc__ = init.__doc__
    settings_cls.__init__ = __init__
    settings_cls.__getattr__ = __getattr__


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
    """Add one flag per option, under its section's heading; an absent flag leaves no
    attribute (the variable applies)."""
    groups: dict[str, Any] = {}
    sections: dict[str | None, Any] = {None: parser}
    for o in options:
        if o.section not in sections:  # one heading per section, in the table's order
            sections[o.section] = parser.add_argument_group(o.section)
        target = sections[o.section]
        if o.group:
            if o.group not in groups:  # one argparse group per name (not one per row)
                groups[o.group] = target.add_mutually_exclusive_group()
            target = groups[o.group]
        default = "hidden" if o.secret else _shown(_default(settings_cls, o))
        need = "required; " if _required(settings_cls, o) else ""
        # %% because argparse formats help strings with %.
        text = f"{o.help} (env {o.env(prefix)}; {need}default: {default})".replace("%", "%%")
        # A boolean flag given alone means true: `--follow` is `--follow true`.
        alone = {"nargs": "?", "const": "true"} if o.parse is boolean else {}
        target.add_argument(f"--{o.name}", dest=o.dest, default=argparse.SUPPRESS,
                            metavar=o.metavar, choices=o.choices, help=text, **alone)


def settings_from(args: argparse.Namespace | None, options: Iterable[Option], settings_cls: type,
                  prefix: str, environ: Mapping[str, str] | None = None, **fixed: Any) -> Any:
    """Flags over ``{prefix}*`` variables over defaults, parsed and validated into settings.

    ``fixed`` values (from code, e.g. tests) win over both.
    """
    environ = os.environ if environ is None else environ
    options = tuple(options)
    given = {o.dest: getattr(args, o.dest, None) if args is not None else None for o in options}
    # A flag of a mutually exclusive group overrides the variables of the whole group.
    flagged = {o.group for o in options if o.group and given[o.dest] is not None}
    values: dict[str, Any] = {}
    for o in options:
        raw, source = given[o.dest], f"--{o.name}"
        if raw is None and o.group in flagged:
            continue
        if raw is None:
            raw, source = environ.get(o.env(prefix)), o.env(prefix)
        if raw is None:
            continue
        if o.choices and raw not in o.choices:
            raise ConfigError(f"{source}: {raw!r} is not one of {', '.join(o.choices)}")
        try:
            values[o.dest] = o.parse(raw)
        except (ValueError, TypeError, ConfigError) as e:
            shown = "***" if o.secret else repr(raw)
            raise ConfigError(f"{source}: invalid value {shown} ({e})") from None
    values.update(fixed)
    missing = [o for o in options if _required(settings_cls, o) and o.dest not in values]
    if missing:
        o = missing[0]
        raise ConfigError(f"--{o.name} (or {o.env(prefix)}) is required")
    return settings_cls(**nest(settings_cls, options, values))


def describe(settings: Any, options: Iterable[Option]) -> dict[str, Any]:
    """The resolved settings for the start-up log, by flat name: secrets masked, paths as
    text, credentials left out of URLs."""
    options = tuple(options)
    rows_of: dict[str, list[Option]] = {}
    for o in options:
        if o.within:
            rows_of.setdefault(o.within, []).append(o)
    out = {}
    for f in dataclasses.fields(settings):
        v = getattr(settings, f.name)
        if f.name not in rows_of:
            out[f.name] = _shown_in_log(v, f.name in {o.dest for o in options if o.secret})
            continue
        for o in rows_of[f.name]:
            out[o.dest] = _shown_in_log(getattr(v, o.attr), o.secret)
    return out


def _shown_in_log(v: Any, secret: bool) -> Any:
    if secret and v is not None:
        return "***"
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, str) and "@" in v:
        return _without_credentials(v)
    return v


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
    """The options as a Markdown table (flag, variable, default, meaning) for the docs, a
    bold row before each section's rows."""
    rows = ["| option | environment variable | default | meaning |", "|---|---|---|---|"]
    heading = None
    for o in options:
        if o.section is not None and o.section != heading:
            rows.append(f"| **{o.section}** | | | |")
        heading = o.section
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
