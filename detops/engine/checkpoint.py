"""Checkpoints: model, optimizer, scheduler, iteration, RNG states and the loss history, with a
`last_checkpoint` file in the output folder naming the newest one."""
from __future__ import annotations

import logging
import os
import random
from typing import Any, Dict, Optional

import numpy as np
import torch

logger = logging.getLogger("detops.engine")


def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def rng_states() -> Dict[str, Any]:
    s = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_states(s: Dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(s["cuda"])


def load_model_state(model, state: Dict[str, torch.Tensor], source: str = "checkpoint") -> None:
    """Load `state` into `model` strictly; on any mismatch raise a ValueError that names the
    missing, unexpected and wrongly-shaped keys."""
    own = _unwrap(model).state_dict()
    state = {k[len("module."):] if k.startswith("module.") else k: v for k, v in state.items()}
    # FrozenBatchNorm2d has no num_batches_tracked; a BatchNorm checkpoint's is harmless there
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own and not k.endswith("num_batches_tracked")]
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and hasattr(state[k], "shape") and tuple(state[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or shapes:
        def few(xs):
            return ", ".join(xs[:8]) + (f", ... ({len(xs)} in all)" if len(xs) > 8 else "")
        parts = []
        if missing:
            parts.append(f"missing keys: {few(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {few(unexpected)}")
        if shapes:
            parts.append(f"shape mismatches: {few(shapes)}")
        raise ValueError(f"{source} does not match the model built from the config (another architecture?): "
                         + "; ".join(parts))
    _unwrap(model).load_state_dict({k: v for k, v in state.items() if k in own})


class Checkpointer:
    """save(name, iteration, **extra) writes OUTPUT_DIR/name.pth (main process only);
    load(path=None) restores the newest checkpoint (or `path`) and returns its extra data."""

    def __init__(self, model, optimizer=None, scheduler=None, save_dir: str = "", save_to_disk: bool = True,
                 scaler=None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.save_dir, self.save_to_disk = save_dir, save_to_disk

    def save(self, name: str, iteration: int, **extra) -> Optional[str]:
        """Call it from every process: each one's RNG states are gathered into the file."""
        from .comm import all_gather
        rngs = all_gather(rng_states())
        if not self.save_dir or not self.save_to_disk:
            return None
        data = {"model": _unwrap(self.model).state_dict(), "iteration": iteration, "rng": rngs}
        if self.optimizer is not None:
            data["optimizer"] = self.optimizer.state_dict()
        if self.scheduler is not None:
            data["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            data["scaler"] = self.scaler.state_dict()
        data.update(extra)
        os.makedirs(self.save_dir, exist_ok=True)
        path = os.path.join(self.save_dir, f"{name}.pth")
        tmp = path + ".tmp"
        torch.save(data, tmp)
        os.replace(tmp, path)  # never a half-written checkpoint, even when interrupted
        with open(os.path.join(self.save_dir, "last_checkpoint"), "w") as f:
            f.write(os.path.basename(path))
        logger.info("saved checkpoint %s (iteration %d)", path, iteration)
        return path

    def last_checkpoint(self) -> Optional[str]:
        f = os.path.join(self.save_dir, "last_checkpoint")
        if not self.save_dir or not os.path.exists(f):
            return None
        with open(f) as fh:
            name = fh.read().strip()
        path = name if os.path.isabs(name) else os.path.join(self.save_dir, name)
        return path if os.path.exists(path) else None

    def load(self, path: Optional[str] = None, model_only: bool = False) -> Dict[str, Any]:
        """Restore from `path` (default: the last checkpoint); {} when there is none."""
        path = path or self.last_checkpoint()
        if not path:
            return {}
        if not os.path.exists(path):
            raise FileNotFoundError(f"checkpoint {path!r} does not exist")
        data = torch.load(path, map_location="cpu", weights_only=False)
        state = data["model"] if isinstance(data, dict) and "model" in data else data
        load_model_state(self.model, state, source=f"checkpoint {path!r}")
        logger.info("loaded %s %s", "weights" if model_only else "checkpoint", path)
        if model_only or not isinstance(data, dict) or "model" not in data:
            return {}
        if self.optimizer is not None and "optimizer" in data:
            self.optimizer.load_state_dict(data["optimizer"])
        if self.scheduler is not None and "scheduler" in data:
            self.scheduler.load_state_dict(data["scheduler"])
        if self.scaler is not None and "scaler" in data:
            self.scaler.load_state_dict(data["scaler"])
        if "rng" in data:
            from .comm import get_rank
            rngs = data["rng"] if isinstance(data["rng"], list) else [data["rng"]]
            set_rng_states(rngs[get_rank()] if get_rank() < len(rngs) else rngs[0])
        return {k: v for k, v in data.items() if k not in ("model", "optimizer", "scheduler", "scaler", "rng")}
