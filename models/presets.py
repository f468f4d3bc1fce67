"""Named starting points of ``ddnn train --preset``: each a few flat fields over the defaults.

A configuration resolves as defaults < preset < config file < flags (``ddnn.models.cli``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddnn.errors import ConfigError
from ddnn.models.config import DDNNConfig


@dataclass(frozen=True)
class Preset:
    """A name, what it is in one line, and the flat fields it changes."""

    name: str
    summary: str
    fields: dict[str, Any]


# The Pi-class devices (pi, deep): double-conv stem blocks, 64 binary features a cell, no
# escalation, channels-last training; they differ in their stem's widths.
_PI_CLASS = {"device_stem": (16, 48), "device_convs": 2, "device_filters": 64,
             "escalate": "none", "channels_last": True}

PRESETS = {p.name: p for p in (
    Preset("tiny", "the default before pi, for the weakest boards: a 16 KB device with a float "
           "stem, escalation of views at 4 bits (docs/training.md, 'Closing the gap'); "
           "DDNNConfig()'s own fields", {}),
    Preset("paper", "the paper's network, the defaults before docs/training.md's changes: one "
           "binarized ConvP block of 4 filters per device, linear device exit, MP-AP, binary "
           "edge features", {
               "scheme": "MP-AP", "device_filters": 4, "device_stem": (), "device_binary": True,
               "device_codec": "binary", "device_exit_float": False, "device_exit_pool": 0,
               "device_scores": "logits", "edge_filters": 16, "edge_per_view": False,
               "edge_codec": "binary", "distill_device": True, "escalate": "none",
               "device_convs": 1}),
    # The default: the cheapest device measured that meets issue 41's accuracy gate on every
    # generated set (the raw-offload reference's accuracy on the mean of two seeds, no seed more
    # than 0.5 points under it, >= 50x fewer uplink bytes): docs/training.md, "A Pi-class
    # default". About half of deep's training step on 2 x86 threads; escalation adds nothing.
    Preset("pi", "the default, a Raspberry Pi-class device: double-conv stem blocks of 16 and 48 "
           "filters, 64 binary features a cell, stacked exits, no escalation (a 125 KB "
           "device)", _PI_CLASS),
    # The default for a while before pi: its fused exit alone matched or beat the raw-offload
    # reference on every generated set at 29-101 B a frame (docs/training.md, "A deep device"),
    # but it trains about 2.5x as long as tiny on 2 cores.
    Preset("deep", "the deepest device measured for a Pi-class board (--deep-device): "
           "double-conv stem blocks of 32 and 64 filters, 64 binary features a cell, no "
           "escalation (about 210 KB a device, about twice pi's training step)",
           {**_PI_CLASS, "device_stem": (32, 64)}),
)}
DEFAULT_PRESET = "pi"  # what `ddnn train` starts from without --preset


def preset(name: str) -> DDNNConfig:
    """The configuration a preset names."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return DDNNConfig.from_flat(**PRESETS[name].fields)
