"""Detector configuration: a yacs CfgNode with maskrcnn-benchmark key names.

    from detops.config import get_cfg
    cfg = get_cfg()
    cfg.merge_from_file("configs/e2e_mask_rcnn_R_50_FPN.yaml")
    cfg.merge_from_list(["MODEL.DEVICE", "cuda"])
"""
from .defaults import _C as cfg


def get_cfg():
    """A fresh, mutable copy of the defaults."""
    return cfg.clone()


__all__ = ["cfg", "get_cfg"]
