"""The training loop: SGD steps over an iteration-indexed data loader, with warm-up/multi-step
LR, optional gradient clipping and CUDA mixed precision, periodic checkpoints and a progress
line (iteration, ETA, smoothed losses, learning rate)."""
from __future__ import annotations

import datetime
import logging
import time
from collections import deque
from typing import Dict, List

import torch

from .comm import get_world_size, is_main_process, reduce_mean

logger = logging.getLogger("detops.engine")


class SmoothedValue:
    def __init__(self, window: int = 20):
        self.values = deque(maxlen=window)

    def update(self, v: float) -> None:
        self.values.append(v)

    @property
    def median(self) -> float:
        s = sorted(self.values)
        return s[len(s) // 2] if s else float("nan")


def _move(targets, device):
    return [{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in t.items()} for t in targets]


def do_train(cfg, model, data_loader, optimizer, scheduler, checkpointer, start_iter: int = 0,
             loss_history: List[Dict[str, float]] = None, on_checkpoint=None) -> List[Dict[str, float]]:
    """Train from start_iter to SOLVER.MAX_ITER; returns the loss history (one dict per iteration:
    "iter", "lr", "loss" and each loss term, averaged over the processes)."""
    device = torch.device(cfg.MODEL.DEVICE)
    s = cfg.SOLVER
    max_iter = s.MAX_ITER
    use_amp = bool(s.AMP) and device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda") if use_amp else None
    if scaler is not None and checkpointer.scaler is None:
        checkpointer.scaler = scaler
    history = list(loss_history or [])
    meters: Dict[str, SmoothedValue] = {}
    model.train()
    t_start = time.time()
    iteration = start_iter
    logger.info("training from iteration %d to %d (%d process(es), %d images per batch)", start_iter, max_iter,
                get_world_size(), s.IMS_PER_BATCH)
    for iteration, (images, targets) in enumerate(data_loader, start_iter):
        iteration += 1  # the number of iterations done once this step ends
        if not images:
            logger.warning("iteration %d: every image of the batch was skipped; no step taken", iteration)
            scheduler.step()
            continue
        images = [img.to(device) for img in images]
        targets = _move(targets, device)
        with torch.autocast(device_type="cuda", enabled=use_amp):
            loss_dict = model(images, targets)
        losses = sum(loss_dict.values())
        if not torch.isfinite(losses):
            raise FloatingPointError(f"iteration {iteration}: the loss is {float(losses)} "
                                     f"({ {k: float(v) for k, v in loss_dict.items()} }); lower SOLVER.BASE_LR "
                                     f"or set SOLVER.CLIP_GRAD_NORM")
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(losses).backward()
            if s.CLIP_GRAD_NORM > 0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.CLIP_GRAD_NORM)
            scaler.step(optimizer)
            scaler.update()
        else:
            losses.backward()
            if s.CLIP_GRAD_NORM > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.CLIP_GRAD_NORM)
            optimizer.step()
        lr = optimizer.param_groups[0]["lr"]
        scheduler.step()

        reduced = reduce_mean(loss_dict)
        total = sum(reduced.values())
        record = {"iter": iteration, "lr": lr, "loss": total, **reduced}
        history.append(record)
        for k, v in record.items():
            if k != "iter":
                meters.setdefault(k, SmoothedValue()).update(v)

        if iteration % s.LOG_PERIOD == 0 or iteration == max_iter or iteration == start_iter + 1:
            per_iter = (time.time() - t_start) / (iteration - start_iter)
            eta = datetime.timedelta(seconds=int(per_iter * (max_iter - iteration)))
            terms = "  ".join(f"{k}: {meters[k].median:.4f}" for k in ["loss"] + sorted(reduced))
            logger.info("iter %d/%d  eta %s  %s  lr %.5f  %.3fs/it", iteration, max_iter, eta, terms, lr, per_iter)
        if iteration % s.CHECKPOINT_PERIOD == 0 and iteration < max_iter:
            checkpointer.save(f"model_{iteration:07d}", iteration, loss_history=history)
            if on_checkpoint is not None and is_main_process():
                on_checkpoint(history)
    if iteration >= max_iter and iteration > start_iter:
        checkpointer.save("model_final", max_iter, loss_history=history)
    total_time = time.time() - t_start
    logger.info("training done: %d iterations in %s (%.3fs/it)", max(iteration - start_iter, 0),
                datetime.timedelta(seconds=int(total_time)), total_time / max(iteration - start_iter, 1))
    return history
