"""The settings of one federation: what ``ddnn federate`` takes and the ServerApp runs with.

One frozen dataclass, validated once; it travels to the ServerApp as Flower's run config
(flat keys, kebab-case, plain values) and back (:meth:`FederationSettings.from_run_config`).
Light: no torch, no Flower.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ddnn.errors import ConfigError
from ddnn.models.federated.strategy import AGGREGATES, DMA_CHECK_STEPS, DMA_THRESHOLD

STRATEGIES = ("fedavg", "dma")
VARIATES = ("sent", "derived")  # SCAFFOLD's control variates: option I or option II
# Each strategy's rounds, local epochs a round and SCAFFOLD (1: on), where the user gives none
# (0 rounds or epochs, -1 scaffold). Measured on the non-IID benchmark's two seeds
# (docs/federated-learning.md): FedAvg gained 2.9 and 0.8 points from 20 x 1 over 10 x 2, then
# SCAFFOLD's 10 x 3 gained 2.9 and 0 points over 20 x 1 (every lower exit better on both) at
# the same bytes and less CPU, and its 10 x 6 another 3.2 and 1.9 (1.37x the CPU, within the
# 15-minute budget); DMA lost 15 points on seed 1 at 20 x 1 (its divergence checks see half
# the local steps a round), and SCAFFOLD is FedAvg's alone.
SCHEDULES = {"fedavg": (10, 6.0, 1), "dma": (10, 2.0, 0)}
# FedAvg's rounds and epochs with SCAFFOLD off (--no-scaffold): the best measured without it;
# six uncorrected epochs a round drift toward each site's classes.
PLAIN_FEDAVG = (20, 1.0)


@dataclass(frozen=True)
class FederationSettings:
    """One federation, from the starting bundle to the new one."""

    bundle: str  # the starting bundle (read on the server)
    out: str  # where the new bundle goes
    work: str  # progress.jsonl and result.json, read by `ddnn federate`
    strategy: str = "fedavg"  # fedavg or dma
    aggregate: str = "mean"  # how good replies combine: mean, trimmed-mean or median
    # Rounds of local training and averaging, local epochs per round (0: the strategy's own,
    # SCHEDULES; filled in on construction, so dataclasses.replace() that changes the
    # strategy keeps the schedule resolved for the old one: pass rounds=0, epochs=0 too).
    rounds: int = 0
    epochs: float = 0.0
    lr: float = 2e-3  # Adam learning rate of the first round (cosine decay over the rounds)
    batch_size: int = 64  # samples per local step
    proximal: float = 0.0  # FedProx's mu: mu/2 ||w - w_round_start||^2 in each site's loss
    # Logit adjustment: tau * log(the site's class prior) on each exit's logits in its loss
    # (1: measured to pay on both seeds of the non-IID benchmark; 0: the plain loss)
    balance: float = 1.0
    momentum: float = 0.0  # fedavg: server momentum (FedAvgM; 0: plain FedAvg)
    # fedavg: SCAFFOLD's control variates correct each site's local steps (1: on, 0: off,
    # -1: the strategy's own, SCHEDULES; resolved on construction as the rounds are)
    scaffold: int = -1
    # SCAFFOLD's variates: "sent" (option I: each site's mean raw gradient goes up, the
    # combined one down, beside the models) or "derived" (option II: each side derives them
    # from the models; only a span travels; models.federated.scaffold)
    variates: str = "sent"
    holdout: float = 0.2  # share of each site's data held out for evaluation and calibration
    seed: int = 0  # seeds the sites' splits, batches and augmentation
    threshold: float = DMA_THRESHOLD  # dma: relative squared divergence that makes a site send
    check_steps: int = DMA_CHECK_STEPS  # dma: local steps between two divergence checks
    min_sites: int = 1  # good replies a round needs to change the model
    wait_sites: int = 1  # sites to wait for before the first round
    join_timeout: float = 300.0  # seconds to wait for them
    round_timeout: float = 600.0  # seconds a round waits for replies (a silent site is dropped)
    # Calibration of the new version: by default (-1, 0) the starting bundle's own budget, as
    # its manifest records it (a tolerance and agreement, or a byte budget).
    tolerance: float = -1.0  # accuracy the hierarchy may lose against its best tier
    agreement: float = -1.0  # with the tolerance: share of frames answered as the best tier
    max_bytes: float = 0.0  # a byte budget instead: the most accurate point within it, B/frame
    grid: int = 201  # calibration: thresholds tried per exit
    threads: int = 1  # torch threads on each site
    version: str = ""  # the new bundle's version (default: the next after the starting one)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.aggregate not in AGGREGATES:
            raise ConfigError(f"aggregate must be one of {AGGREGATES}, got {self.aggregate!r}")
        if (self.rounds < 0 or not 0 <= self.epochs < float("inf") or self.lr <= 0
                or self.batch_size < 1):
            raise ConfigError("lr and batch size must be positive, rounds and epochs positive "
                              "or 0 (the strategy's own)")
        rounds, epochs, scaffold = SCHEDULES[self.strategy]
        if self.scaffold == -1:  # frozen: each set once, here
            object.__setattr__(self, "scaffold", scaffold)
        if self.strategy == "fedavg" and self.scaffold == 0:
            rounds, epochs = PLAIN_FEDAVG
        object.__setattr__(self, "rounds", self.rounds or rounds)
        object.__setattr__(self, "epochs", self.epochs or epochs)
        if not 0.0 <= self.proximal < float("inf"):
            raise ConfigError(f"the proximal weight must be >= 0 (0: none), got {self.proximal}")
        if not 0.0 <= self.balance <= 4.0:
            raise ConfigError(f"the logit adjustment tau must lie in [0, 4] (0: none), got "
                              f"{self.balance}")
        if not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"server momentum must lie in [0, 1), got {self.momentum}")
        if self.scaffold not in (0, 1):
            raise ConfigError(f"scaffold is 1 (on), 0 (off) or -1 (the strategy's own), got "
                              f"{self.scaffold}")
        if self.variates not in VARIATES:
            raise ConfigError(f"variates must be one of {VARIATES}, got {self.variates!r}")
        if self.variates == "derived" and not self.scaffold:
            raise ConfigError("derived variates are SCAFFOLD's, which FedAvg alone runs (its "
                              "default): drop --scaffold-variates derived, or run FedAvg with "
                              "SCAFFOLD")
        if self.variates == "derived" and self.momentum:
            raise ConfigError("derived variates read the shared model's step, which server "
                              "momentum would carry into every site's correction: drop one")
        if self.scaffold and self.strategy != "fedavg":
            raise ConfigError("SCAFFOLD's control variates are FedAvg's: dma sites send no "
                              "model in most rounds")
        if self.momentum and self.strategy != "fedavg":
            raise ConfigError("server momentum is FedAvg's (FedAvgM): dma averages only the "
                              "sites that diverged")
        if not 0.0 < self.holdout < 1.0:
            raise ConfigError("holdout must lie strictly between 0 and 1")
        if self.threshold <= 0 or self.check_steps < 1:
            raise ConfigError("the dma threshold and check interval must be positive")
        if self.min_sites < 1 or self.wait_sites < 1:
            raise ConfigError("min_sites and wait_sites must be at least 1")
        if self.join_timeout <= 0 or self.round_timeout <= 0:
            raise ConfigError("timeouts must be positive")
        for name in ("tolerance", "agreement"):
            value = getattr(self, name)
            if value != -1.0 and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name} must lie in [0, 1] (-1: the starting bundle's), got "
                                  f"{value}")
        if not 0 <= self.max_bytes < float("inf"):
            raise ConfigError(f"max_bytes must be a positive number of bytes (0: none), got "
                              f"{self.max_bytes}")
        if self.max_bytes > 0 and max(self.tolerance, self.agreement) >= 0:
            raise ConfigError("give --max-bytes or --tolerance/--agreement, not both: a version "
                              "is calibrated by one budget")
        if self.grid < 2 or self.threads < 1:
            raise ConfigError("grid >= 2, threads >= 1")

    def run_config(self) -> dict:
        """Flower's run config: kebab-case keys, plain values."""
        return {f.name.replace("_", "-"): getattr(self, f.name)
                for f in dataclasses.fields(self)}

    @classmethod
    def from_run_config(cls, config) -> FederationSettings:
        kinds = {f.name: f.type for f in dataclasses.fields(cls)}
        values = {}
        for name, kind in kinds.items():
            key = name.replace("_", "-")
            if key in config:
                raw = config[key]
                values[name] = {"int": int, "float": float, "str": str}[str(kind)](raw)
        return cls(**values)


def app_defaults() -> dict:
    """The run config's keys with placeholder values, for the Flower App's pyproject (rounds
    and epochs 0 and scaffold -1: the strategy's own, as for ``ddnn federate``)."""
    return {**FederationSettings(bundle="", out="", work="").run_config(),
            "rounds": 0, "epochs": 0.0, "scaffold": -1}
