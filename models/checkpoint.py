"""Training checkpoints: everything to continue a run where it stopped.

Written with ``torch.save`` to a temporary file renamed into place (a crash never leaves half a
checkpoint) and read back with ``weights_only=True``: tensors and plain containers only, no
arbitrary pickled objects. The history travels as JSON text.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def save_checkpoint(path: str | Path, model, opt, sched, run: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "best_state": run["best_state"],
        "run": json.dumps({k: v for k, v in run.items() if k != "best_state"}),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | Path, model, opt, sched) -> dict:
    """Restore model, optimizer and schedule; return the run's counters and best weights."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return {**json.loads(state["run"]), "best_state": state["best_state"]}
