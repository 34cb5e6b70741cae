"""Linear warm-up followed by a multi-step decay, per iteration."""
from __future__ import annotations

from bisect import bisect_right
from typing import Sequence


class WarmupMultiStepLR:
    """lr(it) = base_lr * warmup(it) * gamma ** (number of steps <= it), where warmup(it) rises
    linearly from warmup_factor at it = 0 to 1 at it = warmup_iters ("constant": warmup_factor
    until warmup_iters). step() advances one iteration and sets every param group's lr."""

    def __init__(self, optimizer, steps: Sequence[int], gamma: float = 0.1, warmup_factor: float = 1.0 / 3,
                 warmup_iters: int = 500, warmup_method: str = "linear"):
        if list(steps) != sorted(steps):
            raise ValueError(f"SOLVER.STEPS must be increasing, got {tuple(steps)}")
        if warmup_method not in ("linear", "constant"):
            raise ValueError(f"SOLVER.WARMUP_METHOD must be 'linear' or 'constant', got {warmup_method!r}")
        self.optimizer = optimizer
        self.steps, self.gamma = list(steps), gamma
        self.warmup_factor, self.warmup_iters, self.warmup_method = warmup_factor, warmup_iters, warmup_method
        self.base_lrs = [g.get("initial_lr", g["lr"]) for g in optimizer.param_groups]
        for g, lr in zip(optimizer.param_groups, self.base_lrs):
            g["initial_lr"] = lr
        self.last_iter = 0
        self._apply()

    def factor(self, it: int) -> float:
        w = 1.0
        if it < self.warmup_iters:
            if self.warmup_method == "constant":
                w = self.warmup_factor
            else:
                a = it / self.warmup_iters
                w = self.warmup_factor * (1 - a) + a
        return w * self.gamma ** bisect_right(self.steps, it)

    def _apply(self) -> None:
        f = self.factor(self.last_iter)
        for g, lr in zip(self.optimizer.param_groups, self.base_lrs):
            g["lr"] = lr * f

    def step(self) -> None:
        self.last_iter += 1
        self._apply()

    def get_last_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_iter": self.last_iter, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.last_iter = state["last_iter"]
        self.base_lrs = list(state["base_lrs"])
        self._apply()


def make_optimizer(cfg, model):
    """SGD with momentum; biases get BIAS_LR_FACTOR x the learning rate and WEIGHT_DECAY_BIAS."""
    import torch
    s = cfg.SOLVER
    weights, biases = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (biases if name.endswith("bias") else weights).append(p)
    groups = [{"params": weights, "lr": s.BASE_LR, "weight_decay": s.WEIGHT_DECAY}]
    if biases:
        groups.append({"params": biases, "lr": s.BASE_LR * s.BIAS_LR_FACTOR, "weight_decay": s.WEIGHT_DECAY_BIAS})
    return torch.optim.SGD(groups, lr=s.BASE_LR, momentum=s.MOMENTUM)


def make_lr_scheduler(cfg, optimizer) -> WarmupMultiStepLR:
    s = cfg.SOLVER
    return WarmupMultiStepLR(optimizer, s.STEPS, s.GAMMA, s.WARMUP_FACTOR, s.WARMUP_ITERS, s.WARMUP_METHOD)
