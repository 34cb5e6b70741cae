"""What tools/train_net.py and tools/test_net.py do, callable from Python (and from the tests)."""
from __future__ import annotations

import logging
import os
import random
import sys
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from .comm import get_rank, init_distributed, is_dist, is_main_process, synchronize

logger = logging.getLogger("detops")


class ConfigError(ValueError):
    """A config file or a KEY VALUE override that cannot be applied."""


def setup_cfg(config_file: str = "", opts: Sequence = ()):
    """Defaults, then `config_file`, then the KEY VALUE pairs of `opts`; frozen."""
    from ..config import get_cfg
    cfg = get_cfg()
    if config_file:
        if not os.path.exists(config_file):
            raise ConfigError(f"config file {config_file!r} does not exist")
        try:
            cfg.merge_from_file(config_file)
        except KeyError as e:
            raise ConfigError(f"{config_file}: {e.args[0] if e.args else e}") from None
    opts = list(opts)
    if len(opts) % 2:
        raise ConfigError(f"overrides must be KEY VALUE pairs; got an odd number of items: {opts}")
    for key, value in zip(opts[0::2], opts[1::2]):
        node, parts = cfg, key.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if not isinstance(node, dict) or parts[-1] not in node:
            raise ConfigError(f"unknown config key {key!r} (in the command-line overrides); see "
                              f"detops/config/defaults.py for the keys that exist")
        try:
            cfg.merge_from_list([key, value])
        except (ValueError, AssertionError, KeyError) as e:
            raise ConfigError(f"config key {key!r}: cannot set it to {value!r}: {e}") from None
    cfg.freeze()
    return cfg


def setup_logger(output_dir: str = "", filename: str = "log.txt") -> logging.Logger:
    """Log to stdout (main process) and to OUTPUT_DIR/filename (rank > 0: log_rank<r>.txt)."""
    root = logging.getLogger("detops")
    root.setLevel(logging.INFO)
    root.propagate = False
    for h in list(root.handlers):
        if getattr(h, "_detops", False):
            root.removeHandler(h)
            h.close()
    fmt = logging.Formatter("[%(asctime)s %(name)s %(levelname)s] %(message)s", "%H:%M:%S")
    if is_main_process():
        sh = logging.StreamHandler(sys.stdout)
        sh.setFormatter(fmt)
        sh._detops = True
        root.addHandler(sh)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        name = filename if get_rank() == 0 else f"log_rank{get_rank()}.txt"
        fh = logging.FileHandler(os.path.join(output_dir, name))
        fh.setFormatter(fmt)
        fh._detops = True
        root.addHandler(fh)
    return root


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build_model(cfg):
    from ..modeling import build_detection_model
    c = cfg.clone()
    c.defrost()
    c.MODEL.WEIGHT = ""  # loaded by the Checkpointer, whose errors name mismatched keys
    return build_detection_model(c)


def run_evaluation(cfg, model, save_pictures: bool = True) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Evaluate on every DATASETS.TEST name; print the AP table; draw a few images."""
    from ..data import make_test_loaders
    from .evaluator import evaluate, format_table
    all_results = {}
    for name, ds, loader in make_test_loaders(cfg):
        results = evaluate(model, ds, loader, cfg.MODEL.DEVICE, cfg.OUTPUT_DIR, name)
        if is_main_process():
            table = format_table(name, results)
            logger.info("\n%s", table)
            all_results[name] = results
            if save_pictures and cfg.TEST.VIS_IMAGES > 0:
                save_prediction_pictures(cfg, model, ds, os.path.join(cfg.OUTPUT_DIR, "visualization", name))
        synchronize()
    return all_results


@torch.no_grad()
def save_prediction_pictures(cfg, model, dataset, out_dir: str) -> List[str]:
    from .visualize import draw_detections
    model = model.module if hasattr(model, "module") else model
    model.eval()
    paths = []
    names = getattr(dataset, "CLASSES", ())
    for i in range(min(cfg.TEST.VIS_IMAGES, len(dataset))):
        item = dataset[i]
        if item is None:
            continue
        image, target = item
        pred = model([image.to(cfg.MODEL.DEVICE)])[0]
        paths.append(draw_detections(image, pred, names, os.path.join(out_dir, f"{i:03d}.png"),
                                     cfg.TEST.VIS_SCORE_THRESH, title=f"image {target['image_id']}"))
    logger.info("saved %d pictures of predictions in %s", len(paths), out_dir)
    return paths


def train(cfg, resume: bool = True, evaluate_after: bool = True, max_iter: Optional[int] = None):
    """Train (resuming from OUTPUT_DIR's last checkpoint when `resume`), then evaluate.
    Returns (model, evaluation results)."""
    from ..data import make_train_loader
    from .checkpoint import Checkpointer
    from .lr_scheduler import make_lr_scheduler, make_optimizer
    from .trainer import do_train
    from .visualize import plot_loss_curve

    seed_all(cfg.SEED)
    model = _build_model(cfg)
    device = torch.device(cfg.MODEL.DEVICE)
    optimizer = make_optimizer(cfg, model)
    scheduler = make_lr_scheduler(cfg, optimizer)
    checkpointer = Checkpointer(model, optimizer, scheduler, cfg.OUTPUT_DIR, save_to_disk=is_main_process())
    extra = {}
    if resume and checkpointer.last_checkpoint():
        extra = checkpointer.load()
        logger.info("resumed from %s at iteration %d", checkpointer.last_checkpoint(), extra.get("iteration", 0))
    elif cfg.MODEL.WEIGHT:
        checkpointer.load(cfg.MODEL.WEIGHT, model_only=True)
    start_iter = int(extra.get("iteration", 0))
    train_model = model
    if is_dist():
        ids = [torch.cuda.current_device()] if device.type == "cuda" else None
        train_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=True)
    loader = make_train_loader(cfg, start_iter=start_iter, max_iter=max_iter)
    curve = os.path.join(cfg.OUTPUT_DIR, "loss_curve.png")
    history = do_train(cfg, train_model, loader, optimizer, scheduler, checkpointer, start_iter,
                       extra.get("loss_history"), on_checkpoint=lambda h: plot_loss_curve(h, curve))
    if is_main_process() and cfg.OUTPUT_DIR and history:
        plot_loss_curve(history, curve)
        logger.info("loss curve: %s", curve)
    results = {}
    if evaluate_after and cfg.DATASETS.TEST:
        results = run_evaluation(cfg, model)
    return model, results


def test(cfg, weight: str = "", save_pictures: bool = True):
    """Evaluate `weight` (default: MODEL.WEIGHT, else OUTPUT_DIR's last checkpoint)."""
    from .checkpoint import Checkpointer
    seed_all(cfg.SEED)
    model = _build_model(cfg)
    ck = Checkpointer(model, save_dir=cfg.OUTPUT_DIR)
    path = weight or cfg.MODEL.WEIGHT or ck.last_checkpoint()
    if not path:
        raise FileNotFoundError(f"no weights to evaluate: set MODEL.WEIGHT or train into OUTPUT_DIR "
                                f"({cfg.OUTPUT_DIR!r} has no last_checkpoint)")
    ck.load(path, model_only=True)
    return model, run_evaluation(cfg, model, save_pictures)


def init_from_env(cfg) -> bool:
    """Set up torch.distributed when launched by torchrun; pin this process's CUDA device."""
    return init_distributed(cfg.MODEL.DEVICE)
