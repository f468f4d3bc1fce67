"""The one configuration of a DDNN: its architecture and how it is trained and calibrated.

:class:`DDNNConfig` holds six frozen groups, one per concern: the device segment, the edge,
the cloud, escalation, joint training and calibration. Each group checks its own fields;
:class:`DDNNConfig` checks what spans two of them. A field also has a flat name
(``device_filters``, ``escalate``: :data:`FLAT`), the one ``ddnn train``'s flags, a bundle's
manifest (``training.config``) and the top level of a config file use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from ddnn.aggregation import parse_scheme
from ddnn.codec import LEVEL_BITS
from ddnn.errors import ConfigError

SCHEDULES = ("cosine", "onecycle", "constant")
COMM_HOOKS = ("none", "fp16", "powersgd")
DEVICE_CODECS = {"binary": 1, **LEVEL_BITS, "float16": 0}  # codec: bits per value (0: ReLU)
EDGE_CODECS = ("int8", "float16", "float32", "binary")  # binary: sign features, else ReLU
VIEW_POOLS = ("max", "maxmean")
ESCALATIONS = ("view", "stem", "none")  # an escalated frame's detail (EscalationConfig.detail)
DETAIL_CODECS = {8: "int8", 4: "bits4", 2: "bits2", 1: "binary"}  # bits a value → its codec


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """The device segment: what runs on each camera's board and what it sends."""

    filters: int = 16  # filters of the device block whose output travels (its features)
    stem: tuple[int, ...] = (8, 16)  # float ConvP blocks (ReLU) before that block, each halving
    # the resolution: a deeper device classifies its view far better, and sends a smaller map
    # (16 x 4 x 4 bits = 32 bytes at 32 x 32); (8, 16) fits 16 KB with float16 weights
    convs: int = 1  # 3x3 convolutions in each stem block before its pool (2: VGG-style
    # double-conv blocks, as the reference's trunk)
    binary: bool = False  # binarized (±1) conv weights (eBNN, the paper's); costs about 2
    # points here and saves nothing on the wire
    codec: str = "binary"  # how the features travel, which fixes the last activation: binary
    # (sign, 1 bit a value), bits2 / bits4 (evenly spaced levels in [-1, 1]) or float16 (ReLU)
    exit_float: bool = True  # the device exit reads the last block through a ReLU instead of
    # the quantized features it sends (the exit runs on the device: nothing is lost)
    exit_pool: int = 2  # the exit reads its input average-pooled to k x k cells (0: the whole
    # map, the paper's linear exit; 2 keeps the device under 16 KB)
    scores: str = "logprobs"  # what devices send for the local exit: logits, or logprobs
    # (log-softmax), whose average over views is a product of the views' posteriors
    shared: bool = True  # one device segment for every view (identical cameras learn from
    # every view's images; robust with few samples per camera); False: one per view (paper)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stem", _ints(self.stem))
        _check(self.filters >= 1 and min(self.stem, default=1) >= 1,
               "device filters and stem filters must be positive")
        _check(self.codec in DEVICE_CODECS, f"device codec must be one of {list(DEVICE_CODECS)}")
        _check(1 <= self.convs <= 3, "device convs must be 1, 2 or 3")
        _check(self.convs == 1 or bool(self.stem), "device convs sets the convolutions of the "
               "device stem blocks: give a stem (--device-stem) or leave it at 1")
        _check(self.exit_pool >= 0, "device exit_pool must be >= 0")
        _check(self.scores in ("logits", "logprobs"), "device_scores must be logits or logprobs")

    @property
    def bits(self) -> int:
        """Bits per feature value; 0 for float16 (ReLU) features."""
        return DEVICE_CODECS[self.codec]


@dataclass(frozen=True, kw_only=True)
class EdgeConfig:
    """The local aggregator and the edge segment."""

    scheme: str = "AP-CC"  # local-edge aggregation: average of the device scores, concatenation
    # of the device features (each view keeps its slot; the edge runs on each, see per_view)
    filters: int = 32  # filters of the edge ConvP block
    per_view: bool = True  # with concatenated device features (a *-CC scheme): the edge block
    # on each view with shared weights, then pooled over the present views (late fusion);
    # False runs one block on the concatenation (the paper)
    view_pool: str = "max"  # that pooling: max, or maxmean (maximum and mean side by side)
    codec: str = "int8"  # how edge features travel to the cloud: int8 (ReLU, a byte a value),
    # float16, float32 or binary (sign features, 1 bit a value)

    def __post_init__(self) -> None:
        parse_scheme(self.scheme)
        _check(self.filters >= 1, "edge filters must be positive")
        _check(self.codec in EDGE_CODECS, f"edge codec must be one of {list(EDGE_CODECS)}")
        _check(self.view_pool in VIEW_POOLS, f"edge view_pool must be one of {list(VIEW_POOLS)}")
        _check(not (self.view_pool == "maxmean" and self.codec == "binary"), "maxmean view "
               "pooling gives non-binary edge features: choose another edge codec")


@dataclass(frozen=True, kw_only=True)
class CloudConfig:
    """The cloud's deep segment on the edge features."""

    filters: tuple[int, ...] = (32, 32)  # one ConvP block per entry

    def __post_init__(self) -> None:
        object.__setattr__(self, "filters", _ints(self.filters))
        _check(bool(self.filters) and min(self.filters) >= 1,
               "cloud filters needs at least one positive filter count")


@dataclass(frozen=True, kw_only=True)
class EscalationConfig:
    """What the cloud reads besides the edge features for a frame still unsure at the edge."""

    detail: str = "view"  # from every present camera: "view", its image at reduced resolution;
    # "stem", its last stem block's activations; "none": nothing more. "view" pays on every
    # generated set and seed (+0.9, +20, +15 points on A, B, P: docs/training.md)
    pool: int = 2  # the view's reduction, k x k average pooling (32 x 32 → 16 x 16)
    bits: int = 4  # bits a detail value travels with: 8 (int8), 4, 2 or 1; 4 halves int8's
    # bytes for 3 points of the escalated exit, 2 loses the colours (docs/training.md)
    widths: tuple[int, ...] = (24, 48, 96)  # double-conv blocks of the cloud's CNN on the
    # details: as accurate as 32, 64, 128 here at 56% of the work
    views: int = 0  # details of only the k present views whose devices are surest (lowest
    # entropy of their scores, which the edge already has); 0: every present view

    def __post_init__(self) -> None:
        object.__setattr__(self, "widths", _ints(self.widths))
        _check(self.detail in ESCALATIONS, f"escalate must be one of {list(ESCALATIONS)}")
        _check(self.pool >= 1, "escalate pool must be >= 1")
        _check(self.bits in DETAIL_CODECS, f"escalate bits must be one of {sorted(DETAIL_CODECS)}")
        _check(self.views >= 0, "escalate views must be >= 0 (0: every present view)")
        _check(bool(self.widths) and min(self.widths) >= 1,
               "escalate widths needs at least one positive filter count")

    @property
    def codec(self) -> str:
        """The codec an escalated frame's device detail travels with."""
        return DETAIL_CODECS[self.bits]


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """Joint training of every exit."""

    epochs: int = 60  # passes over the training split (40 left the harder sets under-trained)
    batch_size: int = 64  # samples (each with all its views) per step
    lr: float = 2e-3  # Adam learning rate
    weight_decay: float = 1e-4  # L2 on the float weights; binary weights only see its sign
    exit_weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)  # loss weights of the device, local,
    # edge and cloud exits; the paper trains with equal weights
    seed: int = 0  # seeds the split, the initialization and the batch order: same seed, same bundle
    threads: int = 2  # torch CPU threads; this project's reference machine has 2 cores
    distill: float = 1.0  # weight of online distillation: the cloud exit (detached) teaches the
    # local and edge exits by KL to its softened predictions; 0 turns it off
    distill_device: bool = False  # distillation teaches each device exit too: a single view
    # cannot be as sure as the fused cloud, and copying its confidence spoils their product
    teacher_weight: float = 1.0  # weight of distillation from a raw-view teacher (--teacher)
    distill_temperature: float = 2.0  # softening of the teacher and students in distillation
    lowres_epochs: int = 0  # incremental low-to-high resolution training: the first N epochs
    # see every view at half resolution (2 x 2 blocks averaged, at the input size), then full
    augment: bool = True  # random shift, brightness and view dropout on training batches
    shift: float = 0.1  # largest translation, as a fraction of the image side
    brightness: float = 0.2  # images scaled by a factor in [1 - b, 1 + b] per view
    view_dropout: float = 0.15  # chance a present view is hidden (one view always stays): the
    # hierarchy must answer with cameras missing
    schedule: str = "cosine"  # learning rate: cosine (decay to 0), onecycle (warm-up then
    # cosine) or constant
    patience: int = 0  # stop after this many epochs without a better early-stopping score
    # (0: run every epoch, still keeping the best one)
    stop_fraction: float = 0.15  # share of the training file held out to pick the best epoch
    # and stop early; calibration never sees it, so its thresholds select nothing else
    device: str = "auto"  # torch device: auto (CUDA when present), cpu or cuda
    amp: bool = True  # mixed precision (bf16, else fp16 with loss scaling) when on CUDA
    cpu_amp: bool = False  # bf16 autocast on the CPU too (fast where the CPU has bf16
    # instructions, e.g. AVX-512 BF16; off by default: not every CPU has them)
    comm_hook: str = "none"  # gradient compression between processes: none, fp16, powersgd
    channels_last: bool = False  # train with the conv weights channels-last: the same
    # arithmetic, 22% less time a step for the pi preset's device on 2 x86 threads
    # (docs/training.md, "A Pi-class default"); the bundle's weights are saved as always

    def __post_init__(self) -> None:
        object.__setattr__(self, "exit_weights", tuple(float(w) for w in self.exit_weights))
        _check(self.epochs >= 1 and self.batch_size >= 1 and self.lr > 0,
               "epochs, batch size and learning rate must be positive")
        _check(self.schedule in SCHEDULES, f"schedule must be one of {list(SCHEDULES)}")
        _check(self.comm_hook in COMM_HOOKS, f"comm_hook must be one of {list(COMM_HOOKS)}")
        _check(self.device in ("auto", "cpu", "cuda"), "device must be auto, cpu or cuda")
        _check(self.distill >= 0 and self.distill_temperature > 0 and self.patience >= 0,
               "distill and patience must be >= 0, the temperature positive")
        _check(0 <= self.lowres_epochs < self.epochs, "lowres_epochs must lie in [0, epochs): "
               "the last epochs must see the views at full resolution")
        _check(self.teacher_weight >= 0, "teacher_weight must be >= 0")
        _check(0.0 <= self.view_dropout < 1.0 and 0.0 <= self.shift < 0.5,
               "view_dropout must lie in [0, 1) and shift in [0, 0.5)")
        _check(0.0 < self.stop_fraction < 1.0, "stop_fraction must lie strictly in (0, 1)")
        _check(len(self.exit_weights) == 4 and min(self.exit_weights) >= 0,
               "exit_weights needs four non-negative weights")


@dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """How the exit thresholds are chosen on held-out data."""

    val_fraction: float = 0.2  # share of the training file held out for calibration when no
    # separate validation file is given
    tolerance: float = 0.0  # the budget, as accuracy the hierarchy may lose against its best
    # tier alone on the calibration split in exchange for fewer uplink bytes (0: none)
    agreement: float = 0.995  # ... and the share of that split (less the tolerance) it must
    # answer as the best tier does: a point that only ties with it there by a frame or two of
    # luck loses on new data (the 3-class set: 0.978 against 0.989; docs/training.md)
    max_bytes: float | None = None  # or as uplink payload bytes per frame: the most accurate
    # operating point within it (replaces the tolerance)
    threshold_grid: int = 201  # thresholds tried per exit, evenly spaced in [0, 1]
    stack_exits: bool = True  # each upper tier answers on the one below it (ddnn.stacking), its
    # weight fitted on the held-out splits; False: every tier answers on its own

    def __post_init__(self) -> None:
        _check(0.0 < self.val_fraction < 1.0, "val_fraction must lie strictly between 0 and 1")
        _check(0.0 <= self.tolerance <= 1.0 and 0.0 <= self.agreement <= 1.0,
               "tolerance and agreement must lie in [0, 1]")
        _check(self.max_bytes is None or self.max_bytes >= 0,
               "max_bytes must be a non-negative number of bytes per frame")
        _check(self.threshold_grid >= 2, "threshold_grid needs at least 2 thresholds")


def _typed(name: str, default: Any, value: Any) -> Any:
    """``value`` as the type of the field's ``default`` (a TOML integer for a float field,
    a list for a tuple); a value of another type is a ConfigError naming the field."""
    kind = type(default)
    if isinstance(default, tuple):
        ok = isinstance(value, list | tuple) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    elif default is None or kind is float:  # max_bytes: a number or nothing
        ok = (value is None and default is None) or (
            isinstance(value, int | float) and not isinstance(value, bool))
        value = float(value) if ok and value is not None else value
    else:
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if not ok:
        want = "a list of numbers" if isinstance(default, tuple) else (
            "a number" if default is None or kind is float else kind.__name__)
        raise ConfigError(f"{name} takes {want}, got {value!r}")
    return value


GROUPS = {"device": DeviceConfig, "edge": EdgeConfig, "cloud": CloudConfig,
          "escalation": EscalationConfig, "training": TrainingConfig,
          "calibration": CalibrationConfig}
_DEFAULTS = {g: cls() for g, cls in GROUPS.items()}  # each field's default gives its type
# The flat name of each field (flags, manifests, a config file's top level) → (group, field):
# the device and cloud fields are prefixed with their group, a few keep the names they had.
_RENAMED = {("device", "shared"): "share_device_weights", ("edge", "scheme"): "scheme",
            ("escalation", "detail"): "escalate"}
_PREFIX = {"device": "device_", "edge": "edge_", "cloud": "cloud_", "escalation": "escalate_",
           "training": "", "calibration": ""}
FLAT: dict[str, tuple[str, str]] = {
    _RENAMED.get((g, f.name), _PREFIX[g] + f.name): (g, f.name)
    for g, cls in GROUPS.items() for f in fields(cls)
}


@dataclass(frozen=True, kw_only=True)
class DDNNConfig:
    """Architecture, training and calibration settings, one frozen group per concern.

    The defaults are the ``tiny`` preset's (``ddnn train``'s), measured in docs/training.md
    ("Closing the gap"); the other presets (:func:`ddnn.models.presets.preset`: ``paper``,
    ``pi``) change a few fields of them.
    Build one from flat names with :meth:`from_flat`, change one with :meth:`replace`.
    """

    device: DeviceConfig = field(default_factory=DeviceConfig)
    edge: EdgeConfig = field(default_factory=EdgeConfig)
    cloud: CloudConfig = field(default_factory=CloudConfig)
    escalation: EscalationConfig = field(default_factory=EscalationConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    extra: dict = field(default_factory=dict)  # free-form notes copied into the manifest

    def __post_init__(self) -> None:
        """What spans two groups."""
        _check(self.escalation.detail != "stem" or bool(self.device.stem),
               "escalate 'stem' needs a device stem (--device-stem)")
        _check(self.calibration.val_fraction + self.training.stop_fraction < 0.9,
               "val_fraction and stop_fraction together must leave most data for training")

    @classmethod
    def from_flat(cls, base: DDNNConfig | None = None, /, **values: Any) -> DDNNConfig:
        """``base`` (default: the defaults) with the fields of these flat names changed;
        an unknown name is a :class:`ConfigError` naming the known ones."""
        base = base or cls()
        changes: dict[str, dict[str, Any]] = {}
        extra = values.pop("extra", base.extra)
        for name, value in values.items():
            if name not in FLAT:
                raise ConfigError(f"unknown configuration field {name!r}; known: "
                                  f"{', '.join(sorted(FLAT))}")
            group, key = FLAT[name]
            changes.setdefault(group, {})[key] = _typed(name, getattr(_DEFAULTS[group], key), value)
        groups = {g: replace(getattr(base, g), **kw) for g, kw in changes.items()}
        return replace(base, **groups, extra=dict(extra))

    @classmethod
    def from_saved(cls, saved: dict) -> DDNNConfig:
        """The configuration a bundle's manifest recorded (``training.config``, flat); names
        this ddnn does not know are ignored (a bundle of a newer ddnn)."""
        return cls.from_flat(**{k: v for k, v in saved.items() if k in FLAT or k == "extra"})

    def replace(self, **values: Any) -> DDNNConfig:
        """This configuration with the fields of these flat names changed."""
        return self.from_flat(self, **values)

    @property
    def aggregation(self) -> tuple[str, str]:
        return parse_scheme(self.edge.scheme)

    def to_dict(self) -> dict:
        """Flat names → plain values (lists for tuples): the manifest's ``training.config``."""
        out: dict[str, Any] = {}
        for name, (group, key) in FLAT.items():
            value = getattr(getattr(self, group), key)
            out[name] = list(value) if isinstance(value, tuple) else value
        out["extra"] = dict(self.extra)
        return out

    def to_tables(self) -> dict[str, dict[str, Any]]:
        """Group → field → plain value: a config file's tables."""
        tables = {g: asdict(getattr(self, g)) for g in GROUPS}
        for table in tables.values():
            for key, value in table.items():
                if isinstance(value, tuple):
                    table[key] = list(value)
        if self.extra:
            tables["extra"] = dict(self.extra)
        return tables
