"""One training loop on one process or many: torchrun, DistributedDataParallel, CUDA and AMP.

Started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every process joins the group
(gloo on the CPU, NCCL on CUDA), reads its shard of each epoch (``DistributedSampler``, the same
global batch size as one process), and averages gradients through DDP, optionally compressed by
a communication hook (fp16 or PowerSGD). Rank 0 alone scores epochs, decides when to stop (the
decision is broadcast) and writes checkpoints and the bundle.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import distributed as tdist
from torch.utils.data import DistributedSampler

from ddnn.models.config import DDNNConfig


@dataclass
class Distributed:
    """This process's place in the run: rank, world size, torch device, mixed precision."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    amp_dtype: torch.dtype | None = None
    comm_hook: str = "none"
    scaler: torch.amp.GradScaler | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def precision(self) -> str:
        """The arithmetic of the forward passes: bf16 or fp16 autocast, else fp32."""
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.amp_dtype, "fp32")

    @classmethod
    def from_env(cls, cfg: DDNNConfig) -> Distributed:
        t = cfg.training
        cuda = t.device == "cuda" or (t.device == "auto" and torch.cuda.is_available())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if world > 1 and not tdist.is_initialized():
            tdist.init_process_group("nccl" if cuda else "gloo")
        rank = tdist.get_rank() if world > 1 else 0
        device = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        amp = None
        if cuda and cfg.training.amp:
            amp = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        elif not cuda and cfg.training.cpu_amp:
            amp = torch.bfloat16  # no loss scaling: bf16 has float32's range
        scaler = torch.amp.GradScaler("cuda") if amp == torch.float16 else None
        return cls(rank, world, device, amp, cfg.training.comm_hook, scaler)

    def steps_per_epoch(self, samples: int, batch_size: int) -> int:
        return len(_starts(math.ceil(samples / self.world), self._local_batch(batch_size)))

    def _local_batch(self, batch_size: int) -> int:
        return max(1, math.ceil(batch_size / self.world))

    def batches(self, samples: int, batch_size: int, seed: int, epoch: int):
        """This rank's index batches for ``epoch``: a shuffled shard, same count on every rank."""
        sampler = DistributedSampler(range(samples), num_replicas=self.world, rank=self.rank,
                                     shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        order = np.fromiter(iter(sampler), dtype=np.int64)
        starts = _starts(len(order), self._local_batch(batch_size))
        for i, j in zip(starts, [*starts[1:], len(order)], strict=True):
            yield order[i:j]

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """DDP around ``model`` when there are several processes (the model itself otherwise)."""
        if self.world == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        # PowerSGD chains its collectives per gradient bucket; with gloo, several buckets
        # interleave them differently on each rank (a size mismatch, or a crash), so its
        # gradients travel in one bucket (these models are a few MB at most).
        ddp = DDP(model, device_ids=ids,
                  bucket_cap_mb=1024 if self.comm_hook == "powersgd" else None)
        if self.comm_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.comm_hook == "powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=2,
                                       start_powerSGD_iter=10)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        return ddp

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def backward(self, loss: torch.Tensor, opt: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            loss.backward()
            opt.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (to stop together)."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device if self.device.type == "cuda" else "cpu")
        tdist.broadcast(t, src=0)
        return bool(t.item())

    def barrier(self) -> None:
        if self.world > 1:
            tdist.barrier()

    def close(self) -> None:
        """Leave the group together: every rank waits until all have finished (rank 0 exports
        the bundle first). A rank that tore its group down while the other still ran aborted
        now and then ("terminate called without an active exception", gloo, under load)."""
        if self.world > 1 and tdist.is_initialized():
            try:
                tdist.barrier()
            finally:
                tdist.destroy_process_group()


def _starts(n: int, step: int) -> list[int]:
    """Where each batch of ``n`` samples begins. A last batch of one sample joins the one
    before it: batch norm cannot train on a single sample once a block's map is 1 x 1."""
    starts = list(range(0, n, step))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    return starts
