"""Pooler factory: a detops MultiScaleRoIAlign over the first FPN levels."""
from __future__ import annotations

from ..ops import MultiScaleRoIAlign


def make_pooler(head_cfg) -> MultiScaleRoIAlign:
    """A multi-scale RoIAlign over levels "0".."L-1", L = len(POOLER_SCALES); the scales
    themselves are inferred from the feature maps (powers of two)."""
    names = [str(i) for i in range(len(head_cfg.POOLER_SCALES))]
    return MultiScaleRoIAlign(names, head_cfg.POOLER_RESOLUTION, head_cfg.POOLER_SAMPLING_RATIO)
