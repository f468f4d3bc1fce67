"""``ddnn train --config FILE.toml``: a DDNNConfig as a TOML file, read and written.

A file holds one table per group (``[device]``, ``[edge]``, ``[cloud]``, ``[escalation]``,
``[training]``, ``[calibration]``, keyed by the group's field names) and/or top-level keys by
flat name (``epochs = 5``, ``device_stem = [8, 16]``); ``[extra]`` holds free-form notes.
What :func:`to_toml` writes (a bundle's ``report/config.toml``) reads back to the same
configuration.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from ddnn.errors import ConfigError
from ddnn.models.config import FLAT, GROUPS, DDNNConfig

_FLAT_OF = {group_key: name for name, group_key in FLAT.items()}


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The flat fields a config file sets; an unknown table or key is a ConfigError."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the same parser, from PyPI (the train extra installs it)
        import tomli as tomllib

    try:
        doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read the config file {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "extra" and isinstance(value, dict):
            flat["extra"] = value
        elif key in GROUPS and isinstance(value, dict):
            flat.update(_table(path, key, value))
        elif key in FLAT:
            flat[key] = value
        else:
            raise ConfigError(f"{path}: unknown key {key!r}; a config file holds the tables "
                              f"{', '.join(f'[{g}]' for g in GROUPS)}, [extra] and the top-level "
                              f"keys {', '.join(sorted(FLAT))}")
    return flat


def _table(path: str | Path, group: str, table: dict[str, Any]) -> dict[str, Any]:
    known = [f.name for f in fields(GROUPS[group])]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ConfigError(f"{path}: unknown key {unknown[0]!r} in [{group}]; its keys are "
                          f"{', '.join(known)}")
    return {_FLAT_OF[(group, k)]: v for k, v in table.items()}


def to_toml(cfg: DDNNConfig, comment: str = "") -> str:
    """The configuration as a config file (``comment``: lines put first, each as ``# ...``)."""
    lines = [f"# {line}".rstrip() for line in comment.splitlines()]
    for group, table in cfg.to_tables().items():
        lines += ["", f"[{group}]"]
        lines += [f"{k} = {_value(v)}" for k, v in table.items() if v is not None]
        lines += [f"# {k}: not set" for k, v in table.items() if v is None]
    return "\n".join(lines).lstrip("\n") + "\n"


def _value(v: Any) -> str:
    """A TOML literal of a config value (bool, int, float, str, or a list of them)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and not math.isfinite(v):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: the same escapes
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to a config file (bool, number, string or list)")
