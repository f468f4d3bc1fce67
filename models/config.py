"""The one configuration of a DDNN: its architecture and how it is trained and calibrated."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ddnn.aggregation import parse_scheme
from ddnn.codec import CODECS
from ddnn.errors import ConfigError

SCHEDULES = ("cosine", "onecycle", "constant")
COMM_HOOKS = ("none", "fp16", "powersgd")


@dataclass
class DDNNConfig:
    """Architecture, training and calibration settings; the defaults follow the paper."""

    # --- architecture ---------------------------------------------------------------------
    scheme: str = "MP-AP"  # local-edge aggregation: max of the device scores, average of the
    # device features; averaging keeps the edge input the same whichever views are missing
    # (the paper's MP-CC zero-fills them) and gave a stronger cloud exit (docs/training.md)
    device_filters: int = 4  # conv filters per device; the paper uses 4 to fit embedded memory
    device_binary: bool = True  # binarized weights and sign activations on the device (eBNN);
    # False gives a float conv with ReLU features sent as float16
    share_device_weights: bool = True  # one device segment for every view (identical
    # cameras learn from every view's images; robust with few samples per camera); False
    # trains one per view as in the paper
    edge_filters: int = 16  # filters of the edge ConvP block
    cloud_filters: tuple[int, ...] = (32, 32)  # one ConvP block per entry: the deep segment
    edge_codec: str = "binary"  # how edge features travel to the cloud; binary keeps them 1-bit
    # --- joint training -------------------------------------------------------------------
    epochs: int = 40  # passes over the training split; the network is small and converges fast
    batch_size: int = 64  # samples (each with all its views) per step
    lr: float = 2e-3  # Adam learning rate
    weight_decay: float = 1e-4  # L2 on the float weights; binary weights only see its sign
    exit_weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)  # loss weights of the
    # device, local, edge and cloud exits; the paper trains with equal weights
    seed: int = 0  # seeds the split, the initialization and the batch order: same seed, same bundle
    threads: int = 2  # torch CPU threads; this project's reference machine has 2 cores
    distill: float = 1.0  # weight of online distillation: the cloud exit (detached) teaches
    # the device, local and edge exits by KL to its softened predictions; 0 turns it off
    distill_temperature: float = 2.0  # softening of the teacher and students in distillation
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
    comm_hook: str = "none"  # gradient compression between processes: none, fp16, powersgd
    # --- calibration ----------------------------------------------------------------------
    val_fraction: float = 0.2  # share of the training file held out for calibration and early
    # stopping when no separate validation file is given
    tolerance: float = 0.0  # accuracy the hierarchy may lose against the cloud exit alone on the
    # validation split in exchange for earlier exits (0: none)
    threshold_grid: int = 201  # thresholds tried per exit, evenly spaced in [0, 1]
    extra: dict = field(default_factory=dict)  # free-form notes copied into the manifest

    def __post_init__(self) -> None:
        parse_scheme(self.scheme)
        self.cloud_filters = tuple(int(f) for f in self.cloud_filters)
        self.exit_weights = tuple(float(w) for w in self.exit_weights)  # type: ignore[assignment]
        if self.device_filters < 1 or self.edge_filters < 1 or not self.cloud_filters:
            raise ConfigError("filter counts must be positive and the cloud needs a block")
        if self.edge_codec not in CODECS:
            raise ConfigError(f"edge codec must be one of {CODECS}")
        if self.epochs < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ConfigError("epochs, batch size and learning rate must be positive")
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError("val_fraction must lie strictly between 0 and 1")
        if not 0.0 <= self.tolerance <= 1.0:
            raise ConfigError("tolerance must lie in [0, 1]")
        if self.schedule not in SCHEDULES or self.comm_hook not in COMM_HOOKS:
            raise ConfigError(f"schedule must be one of {SCHEDULES}, comm_hook one of {COMM_HOOKS}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError("device must be auto, cpu or cuda")
        if self.distill < 0 or self.distill_temperature <= 0 or self.patience < 0:
            raise ConfigError("distill and patience must be >= 0, the temperature positive")
        if not 0.0 <= self.view_dropout < 1.0 or not 0.0 <= self.shift < 0.5:
            raise ConfigError("view_dropout must lie in [0, 1) and shift in [0, 0.5)")
        if not 0.0 < self.stop_fraction < 1.0 or self.val_fraction + self.stop_fraction >= 0.9:
            raise ConfigError("stop_fraction must be positive and leave most data for training")
        if len(self.exit_weights) != 4 or min(self.exit_weights) < 0:
            raise ConfigError("exit_weights needs four non-negative weights")

    @property
    def aggregation(self) -> tuple[str, str]:
        return parse_scheme(self.scheme)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["cloud_filters"] = list(self.cloud_filters)
        d["exit_weights"] = list(self.exit_weights)
        return d
