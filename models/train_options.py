"""``ddnn train``'s configuration flags, grouped by concern, and how a configuration resolves.

Each flag stores under its field's flat name (``ddnn.models.config.FLAT``) and only when it is
given, so :func:`resolve` can layer them: defaults < preset < config file < flags.
"""

from __future__ import annotations

from argparse import SUPPRESS, ArgumentParser, ArgumentTypeError, Namespace
from typing import Any

from ddnn.errors import ConfigError
from ddnn.models.config import DEVICE_CODECS, EDGE_CODECS, ESCALATIONS, FLAT, DDNNConfig
from ddnn.models.presets import DEFAULT_PRESET, PRESETS, preset

_DEFAULTS = preset(DEFAULT_PRESET).to_dict()  # what each flag's help names as its default


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated filter counts ('' for none)."""
    try:
        return tuple(int(f) for f in text.split(",") if f.strip())
    except ValueError:
        raise ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None


def _option(g, flag: str, key: str, text: str, **kw) -> None:
    """A flag that sets ``key`` to its value; its help names the default."""
    default = _DEFAULTS[key]
    if isinstance(default, list):
        default = ",".join(map(str, default))
    g.add_argument(flag, dest=key, default=SUPPRESS, help=f"{text} (default: {default})", **kw)


def _switch(g, flag: str, key: str, value: Any, text: str) -> None:
    """A flag without a value that sets ``key`` to ``value``."""
    g.add_argument(flag, dest=key, action="store_const", const=value, default=SUPPRESS,
                   help=text)


def add_common(t: ArgumentParser) -> None:
    """The preset, the config file and the options most runs change."""
    names = ", ".join(PRESETS)
    t.add_argument("--preset", choices=list(PRESETS), default=SUPPRESS,
                   help=f"a named configuration to start from: {names} (default: "
                   f"{DEFAULT_PRESET}; see above)")
    t.add_argument("--config", default=None, metavar="FILE.toml",
                   help="a configuration file over the preset; flags override it (a bundle's "
                   "report/config.toml trains the same configuration again)")
    t.add_argument("--print-config", action="store_true",
                   help="print the effective configuration as a config file and exit")
    t.add_argument("--paper", action="store_true", help="same as --preset paper")
    t.add_argument("--deep-device", action="store_true", help="same as --preset deep")
    _option(t, "--epochs", "epochs", "training epochs", type=int)
    _option(t, "--seed", "seed", "seed of split, init and batches", type=int)


def add_groups(t: ArgumentParser) -> None:
    """The other configuration flags, one argument group per concern."""
    _device(t.add_argument_group("device segment"))
    g = t.add_argument_group("edge")
    _option(g, "--scheme", "scheme", "local-edge aggregation scheme: AP-CC, MP-CC, MP-AP, MP, "
            "AP, CC, ...")
    _option(g, "--edge-filters", "edge_filters", "edge conv filters", type=int)
    _option(g, "--edge-codec", "edge_codec", "how edge features travel to the cloud",
            choices=list(EDGE_CODECS))
    _switch(g, "--early-fusion", "edge_per_view", False, "with a *-CC scheme, one edge block on "
            "the concatenated views (the paper) instead of one per view pooled over the views")
    g = t.add_argument_group("cloud")
    _option(g, "--cloud-filters", "cloud_filters", "filters of each cloud ConvP block, "
            "comma-separated (deeper: more)", type=int_list)
    _escalation(t.add_argument_group("escalation"))
    _training(t.add_argument_group("training"))
    _calibration(t.add_argument_group("calibration"))
    g = t.add_argument_group("hardware")
    _option(g, "--device", "device", "torch device (auto: CUDA when present)",
            choices=["auto", "cpu", "cuda"])
    _switch(g, "--no-amp", "amp", False, "no mixed precision on CUDA")
    _switch(g, "--cpu-amp", "cpu_amp", True,
            "bf16 autocast on the CPU (fast on CPUs with bf16 instructions)")
    _option(g, "--threads", "threads", "torch CPU threads", type=int)
    _option(g, "--comm-hook", "comm_hook", "gradient compression between torchrun processes",
            choices=["none", "fp16", "powersgd"])


def _device(g) -> None:
    _option(g, "--device-filters", "device_filters",
            "filters of the device block whose features travel", type=int)
    _option(g, "--device-stem", "device_stem", "float ConvP blocks before it, comma-separated "
            "filter counts, '' for none", type=int_list)
    _option(g, "--device-convs", "device_convs", "3x3 convolutions in each device stem block "
            "before its pool", type=int, choices=[1, 2, 3])
    _option(g, "--device-codec", "device_codec", "how device features travel",
            choices=list(DEVICE_CODECS))
    _switch(g, "--float-device", "device_codec", "float16",
            "float ReLU device features sent as float16 (--device-codec float16)")
    _switch(g, "--binary-weights", "device_binary", True,
            "binarized (+-1) device conv weights, as the paper's eBNN devices")
    _option(g, "--device-exit-pool", "device_exit_pool",
            "device exit reads its input pooled to K x K (0: the whole map)", type=int)
    _option(g, "--device-scores", "device_scores", "what devices send for the local exit",
            choices=["logits", "logprobs"])
    _switch(g, "--per-view-devices", "share_device_weights", False,
            "train one device segment per view (the paper) instead of one shared")


def _escalation(g) -> None:
    _option(g, "--escalate", "escalate", "the detail the cloud reads besides the edge features "
            "for a frame still unsure after the edge exit, from every present camera: 'view', "
            "its image at reduced resolution; 'stem', its stem's activations; 'none': no "
            "escalated cloud", choices=list(ESCALATIONS))
    _option(g, "--escalate-pool", "escalate_pool",
            "the view's reduction, K x K average pooling", type=int)
    _option(g, "--escalate-bits", "escalate_bits", "bits a detail value travels with",
            type=int, choices=[8, 4, 2, 1])
    _option(g, "--escalate-views", "escalate_views", "escalate the details of only the K "
            "present views whose devices are surest (0: every present view)", type=int)
    _option(g, "--escalate-widths", "escalate_widths", "double-conv blocks of the cloud's CNN "
            "on the details, comma-separated", type=int_list)


def _training(g) -> None:
    _option(g, "--batch-size", "batch_size", "samples per step", type=int)
    _option(g, "--lr", "lr", "Adam learning rate", type=float)
    _option(g, "--schedule", "schedule", "learning-rate schedule",
            choices=["cosine", "onecycle", "constant"])
    _option(g, "--patience", "patience",
            "stop after this many epochs without improvement (0: never early)", type=int)
    _option(g, "--stop-fraction", "stop_fraction",
            "share of --data held out to pick the epoch (never used to calibrate)", type=float)
    _option(g, "--distill", "distill",
            "weight of online distillation from the cloud exit (0: off)", type=float)
    _switch(g, "--distill-device", "distill_device", True,
            "distillation teaches the device exits too (the paper preset does)")
    g.add_argument("--teacher", default=None, metavar="BUNDLE",
                   help="a raw-offload bundle (--baseline) whose answers every exit also "
                   "learns from (knowledge distillation)")
    _option(g, "--teacher-weight", "teacher_weight", "weight of the teacher's distillation loss",
            type=float)
    _option(g, "--lowres-epochs", "lowres_epochs", "incremental low-to-high resolution "
            "training: the first N epochs see the views at half resolution (0: off)", type=int)
    _switch(g, "--no-augment", "augment", False,
            "no shift, brightness or view-dropout augmentation")
    g.add_argument("--checkpoint", default=None,
                   help="checkpoint file written every epoch (by rank 0)")
    g.add_argument("--resume", action="store_true", help="continue from --checkpoint if present")


def _calibration(g) -> None:
    _option(g, "--tolerance", "tolerance", "calibration budget: accuracy the hierarchy may lose "
            "against its best tier on held-out data; the cheapest operating point within it is "
            "chosen", type=float)
    _option(g, "--agreement", "agreement", "with --tolerance: the share of held-out frames "
            "(less the tolerance) on which the chosen point must answer as the best tier does "
            "(1: every frame; 0: accuracy alone)", type=float)
    _option(g, "--max-bytes", "max_bytes", "calibration budget instead: device uplink payload "
            "bytes per frame; the most accurate operating point within it on held-out data is "
            "chosen", type=float)
    _switch(g, "--no-stacking", "stack_exits", False, "every upper exit answers on its own, not "
            "stacked on the answer of the tier below it (stacking weights are fitted on "
            "held-out data; docs/training.md)")
    _option(g, "--val-fraction", "val_fraction", "share of --data held out when --val is not "
            "given", type=float)


def preset_name(args: Namespace) -> str:
    """--preset, or the preset --paper / --deep-device stand for (one of them at most)."""
    given = vars(args).get("preset")
    named = {n for n, on in ((given, given), ("paper", args.paper), ("deep", args.deep_device))
             if on}
    if len(named) > 1:
        raise ConfigError(f"--preset, --paper and --deep-device name two different networks "
                          f"({', '.join(sorted(named))}): choose one")
    return named.pop() if named else DEFAULT_PRESET


def resolve(args: Namespace) -> DDNNConfig:
    """The configuration ``ddnn train``'s arguments ask for: the defaults, then the preset,
    then the config file (--config), then the flags given."""
    fields = dict(PRESETS[preset_name(args)].fields)
    if args.config:
        from ddnn.models.config_file import read_config_file

        fields.update(read_config_file(args.config))
    fields.update({k: v for k, v in vars(args).items() if k in FLAT})
    return DDNNConfig.from_flat(**fields)
