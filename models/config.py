"""The one configuration of a DDNN: its architecture and how it is trained and calibrated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ddnn.aggregation import parse_scheme
from ddnn.codec import LEVEL_BITS
from ddnn.errors import ConfigError

SCHEDULES = ("cosine", "onecycle", "constant")
COMM_HOOKS = ("none", "fp16", "powersgd")
DEVICE_CODECS = {"binary": 1, **LEVEL_BITS, "float16": 0}  # codec: bits per value (0: ReLU)
EDGE_CODECS = ("int8", "float16", "float32", "binary")  # binary: sign features, else ReLU
VIEW_POOLS = ("max", "maxmean")
ESCALATIONS = ("view", "stem", "none")  # an escalated frame's detail (see DDNNConfig.escalate)
DETAIL_CODECS = {8: "int8", 4: "bits4", 2: "bits2", 1: "binary"}  # bits a value → its codec
PAPER = {  # DDNNConfig.paper(): the architecture before docs/training.md's "Closing the gap"
    "scheme": "MP-AP", "device_filters": 4, "device_stem": (), "device_binary": True,
    "device_codec": "binary", "device_exit_float": False, "device_exit_pool": 0,
    "device_scores": "logits", "edge_filters": 16, "edge_per_view": False,
    "edge_codec": "binary", "distill_device": True, "escalate": "none", "device_convs": 1,
}
DEEP_DEVICE = {  # DDNNConfig.deep_device(): a device as deep as a small board affords (Raspberry
    # Pi class: about 105 k weights, 210 KB of float16), whose fused exit alone matched or beat the
    # raw-offload reference on the generated sets at 29-101 B a frame (docs/training.md, "A deep
    # device"); the details of escalation then add nothing, so it is off
    "device_stem": (32, 64), "device_convs": 2, "device_filters": 64, "escalate": "none",
}


@dataclass
class DDNNConfig:
    """Architecture, training and calibration settings.

    The defaults are measured in docs/training.md ("Closing the gap"); :meth:`paper` gives the
    paper's network (the defaults before that work) for comparison.
    """

    # --- architecture ---------------------------------------------------------------------
    scheme: str = "AP-CC"  # local-edge aggregation: average of the device scores (log-
    # probabilities: a product of the views' posteriors), concatenation of the device features
    # (each view keeps its slot; the edge runs on each, see edge_per_view)
    device_filters: int = 16  # filters of the device block whose output travels (its features)
    device_stem: tuple[int, ...] = (8, 16)  # float ConvP blocks (ReLU) before that block,
    # each halving the resolution: a deeper device classifies its view far better, and sends a
    # smaller map (16 x 4 x 4 bits = 32 bytes at 32 x 32); (8, 16) fits 16 KB with the device
    # weights stored as float16 (models.export.store_float16)
    device_convs: int = 1  # 3x3 convolutions in each stem block before its pool (2: VGG-style
    # double-conv blocks, as the reference's trunk)
    device_binary: bool = False  # binarized (±1) conv weights on the device (eBNN, the paper's);
    # costs about 2 points here and saves nothing on the wire
    device_codec: str = "binary"  # how device features travel, which fixes the last device
    # activation: binary (sign, 1 bit a value), bits2 / bits4 (2 or 4 bits, evenly spaced
    # levels in [-1, 1]) or float16 (ReLU)
    device_exit_float: bool = True  # the device exit reads the last block through a ReLU
    # instead of the quantized features it sends (the exit runs on the device: nothing is lost)
    device_exit_pool: int = 2  # the device exit reads its input average-pooled to k x k cells
    # (0: the whole map, the paper's linear exit; 2 keeps the device under 16 KB)
    device_scores: str = "logprobs"  # what devices send for the local exit: logits, or
    # logprobs (log-softmax), whose average over views is a product of the views' posteriors
    share_device_weights: bool = True  # one device segment for every view (identical
    # cameras learn from every view's images; robust with few samples per camera); False
    # trains one per view as in the paper
    edge_filters: int = 32  # filters of the edge ConvP block
    edge_per_view: bool = True  # with concatenated device features (a *-CC scheme): run the
    # edge block on each view with shared weights, then pool over the present views (late
    # fusion); False runs one block on the concatenation (the paper)
    edge_view_pool: str = "max"  # that pooling: max, or maxmean (maximum and mean side by side)
    cloud_filters: tuple[int, ...] = (32, 32)  # one ConvP block per entry: the deep segment
    edge_codec: str = "int8"  # how edge features travel to the cloud: int8 (ReLU features,
    # one byte a value), float16, or binary (sign features, 1 bit a value)
    escalate: str = "view"  # the detail the cloud reads besides the edge features for a frame
    # still unsure after the edge exit, from every present camera: "view", its image at reduced
    # resolution; "stem", its last stem block's activations; "none": nothing more. "view" pays
    # on every generated set and seed (+0.9, +20, +15 points on A, B, P: docs/training.md)
    escalate_pool: int = 2  # the view's reduction, k x k average pooling (32 x 32 → 16 x 16)
    escalate_bits: int = 4  # bits a detail value travels with: 8 (int8), 4, 2 or 1; 4 halves
    # int8's bytes for 3 points of the escalated exit, 2 loses the colours (docs/training.md)
    escalate_widths: tuple[int, ...] = (24, 48, 96)  # double-conv blocks of the cloud's CNN
    # on the details: as accurate as 32, 64, 128 here at 56% of the work
    escalate_views: int = 0  # details of only the k present views whose devices are surest
    # (lowest entropy of their scores, which the edge already has); 0: every present view
    # --- joint training -------------------------------------------------------------------
    epochs: int = 60  # passes over the training split (40 left the harder sets under-trained)
    batch_size: int = 64  # samples (each with all its views) per step
    lr: float = 2e-3  # Adam learning rate
    weight_decay: float = 1e-4  # L2 on the float weights; binary weights only see its sign
    exit_weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)  # loss weights of the
    # device, local, edge and cloud exits; the paper trains with equal weights
    seed: int = 0  # seeds the split, the initialization and the batch order: same seed, same bundle
    threads: int = 2  # torch CPU threads; this project's reference machine has 2 cores
    distill: float = 1.0  # weight of online distillation: the cloud exit (detached) teaches
    # the local and edge exits by KL to its softened predictions; 0 turns it off
    distill_device: bool = False  # distillation teaches each device exit too: a single view
    # cannot be as sure as the fused cloud, and copying its confidence spoils their product
    teacher_weight: float = 1.0  # weight of distillation from a raw-view teacher (--teacher)
    distill_temperature: float = 2.0  # softening of the teacher and students in distillation
    lowres_epochs: int = 0  # incremental low-to-high resolution training: the first N epochs
    # see every view at half resolution (2 x 2 blocks averaged, at the input size), then full
    augment: bool = True  # random shift, brightness and view dropout on training batches
    shift: float = 0.1  # largest translation, as a fraction of the image side
    brightness: float = 0.2  # images scaled by a factor in [1 - b, 1 + b] per view
    view_dropout: float = 0.15  # chance a present view is hidden (one view always stays):
    # the hierarchy must answer with cameras missing
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
    # --- calibration ----------------------------------------------------------------------
    val_fraction: float = 0.2  # share of the training file held out for calibration and early
    # stopping when no separate validation file is given
    tolerance: float = 0.0  # the budget, as accuracy the hierarchy may lose against its best
    # tier alone on the calibration split in exchange for fewer uplink bytes (0: none)
    agreement: float = 0.995  # ... and the share of that split (less the tolerance) it must
    # answer as the best tier does: a point that only ties with it there by a frame or two of
    # luck loses on new data (the 3-class set: 0.978 against 0.989; docs/training.md)
    max_bytes: float | None = None  # or as uplink payload bytes per frame: the most accurate
    # operating point within it (replaces the tolerance)
    threshold_grid: int = 201  # thresholds tried per exit, evenly spaced in [0, 1]
    # Stacked exits (ddnn.stacking): each upper tier's answer on the one below it, its weight
    # fitted on the held-out splits; False: every tier answers on its own, as before
    stack_exits: bool = True
    extra: dict = field(default_factory=dict)  # free-form notes copied into the manifest

    def __post_init__(self) -> None:
        parse_scheme(self.scheme)
        self.cloud_filters = tuple(int(f) for f in self.cloud_filters)
        self.device_stem = tuple(int(f) for f in self.device_stem)
        self.escalate_widths = tuple(int(f) for f in self.escalate_widths)
        self.exit_weights = tuple(float(w) for w in self.exit_weights)  # type: ignore[assignment]
        if self.device_filters < 1 or self.edge_filters < 1 or not self.cloud_filters:
            raise ConfigError("filter counts must be positive and the cloud needs a block")
        if self.edge_codec not in EDGE_CODECS:
            raise ConfigError(f"edge codec must be one of {EDGE_CODECS}")
        if self.device_codec not in DEVICE_CODECS:
            raise ConfigError(f"device codec must be one of {DEVICE_CODECS}")
        if not 1 <= self.device_convs <= 3:
            raise ConfigError("device_convs must be 1, 2 or 3")
        if self.device_convs > 1 and not self.device_stem:
            raise ConfigError("device_convs sets the convolutions of the device stem blocks: "
                              "give a stem (--device-stem) or leave it at 1")
        if min(self.device_stem, default=1) < 1 or self.device_exit_pool < 0:
            raise ConfigError("device stem filters must be positive, device_exit_pool >= 0")
        if self.escalate not in ESCALATIONS or self.escalate_pool < 1:
            raise ConfigError(f"escalate must be one of {ESCALATIONS}, escalate_pool >= 1")
        if self.escalate_bits not in DETAIL_CODECS:
            raise ConfigError(f"escalate_bits must be one of {sorted(DETAIL_CODECS)}")
        if self.escalate_views < 0:
            raise ConfigError("escalate_views must be >= 0 (0: every present view)")
        if self.escalate == "stem" and not self.device_stem:
            raise ConfigError("escalate 'stem' needs a device stem (--device-stem)")
        if not self.escalate_widths or min(self.escalate_widths) < 1:
            raise ConfigError("escalate_widths needs at least one positive filter count")
        if self.device_scores not in ("logits", "logprobs"):
            raise ConfigError("device_scores must be logits or logprobs")
        if self.edge_view_pool not in VIEW_POOLS:
            raise ConfigError(f"edge_view_pool must be one of {VIEW_POOLS}")
        if self.edge_view_pool == "maxmean" and self.edge_codec == "binary":
            raise ConfigError("maxmean view pooling gives non-binary edge features: choose "
                              "another edge codec")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("epochs, batch size and learning rate must be positive")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError("val_fraction must lie strictly between 0 and 1")
        if not 0.0 <= self.tolerance <= 1.0 or not 0.0 <= self.agreement <= 1.0:
            raise ConfigError("tolerance and agreement must lie in [0, 1]")
        if self.max_bytes is not None and not self.max_bytes >= 0:
            raise ConfigError("max_bytes must be a non-negative number of bytes per frame")
        if self.schedule not in SCHEDULES or self.comm_hook not in COMM_HOOKS:
            raise ConfigError(f"schedule must be one of {SCHEDULES}, comm_hook one of {COMM_HOOKS}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device must be auto, cpu or cuda")
        if self.distill < 0 or self.distill_temperature <= 0 or self.patience < 0:
            raise ConfigError("distill and patience must be >= 0, the temperature positive")
        if not 0 <= self.lowres_epochs < self.epochs:
            raise ConfigError("lowres_epochs must lie in [0, epochs): the last epochs must see "
                              "the views at full resolution")
        if self.teacher_weight < 0:
            raise ConfigError("teacher_weight must be >= 0")
        if not 0.0 <= self.view_dropout < 1.0 or not 0.0 <= self.shift < 0.5:
            raise ConfigError("view_dropout must lie in [0, 1) and shift in [0, 0.5)")
        if not 0.0 < self.stop_fraction < 1.0 or self.val_fraction + self.stop_fraction >= 0.9:
            raise ConfigError("stop_fraction must be positive and leave most data for training")
        if len(self.exit_weights) != 4 or min(self.exit_weights) < 0:
            raise ConfigError("exit_weights needs four non-negative weights")

    @classmethod
    def paper(cls, **overrides) -> DDNNConfig:
        """The paper's network, this project's defaults before docs/training.md's changes:
        one binarized ConvP block of 4 filters per device with a linear exit on its features,
        max of the device logits, average of the device features, binary edge features."""
        return cls(**{**PAPER, **overrides})

    @classmethod
    def deep_device(cls, **overrides) -> DDNNConfig:
        """A deep device for a Raspberry Pi-class board: two double-conv stem blocks (32 and 64
        filters) and 64 binary features a cell (128 B a view), no escalation."""
        return cls(**{**DEEP_DEVICE, **overrides})

    @property
    def device_bits(self) -> int:
        """Bits per device feature value; 0 for float16 (ReLU) features."""
        return DEVICE_CODECS[self.device_codec]

    @property
    def detail_codec(self) -> str:
        """The codec an escalated frame's device detail travels with."""
        return DETAIL_CODECS[self.escalate_bits]

    @property
    def aggregation(self) -> tuple[str, str]:
        return parse_scheme(self.scheme)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cloud_filters"] = list(self.cloud_filters)
        d["device_stem"] = list(self.device_stem)
        d["exit_weights"] = list(self.exit_weights)
        d["escalate_widths"] = list(self.escalate_widths)
        return d
