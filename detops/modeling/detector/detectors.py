"""build_detection_model: MODEL.META_ARCHITECTURE -> a registered detector."""
from __future__ import annotations

import torch
from torch import nn

from ..registry import META_ARCH_REGISTRY
from . import generalized_rcnn  # noqa: F401  (registers GeneralizedRCNN)


def build_detection_model(cfg) -> nn.Module:
    """The detector described by `cfg`, on cfg.MODEL.DEVICE, with cfg.MODEL.WEIGHT loaded
    when set (a detops state_dict, or a checkpoint dict holding one under "model")."""
    model = META_ARCH_REGISTRY[cfg.MODEL.META_ARCHITECTURE](cfg)
    if cfg.MODEL.WEIGHT:
        state = torch.load(cfg.MODEL.WEIGHT, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "model" in state:
            state = state["model"]
        model.load_state_dict(state)
    return model.to(cfg.MODEL.DEVICE)
