"""Synthetic inputs shared by the tests and the benchmarks (deterministic by seed)."""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor


def registered_ops(namespace: str = "detops") -> List[str]:
    """The names of the ops registered in `namespace` (detops' schemas, csrc/vision.cpp), sorted,
    without the namespace: the op lists of the tests derive from it."""
    prefix = namespace + "::"
    return sorted({n[len(prefix):].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(prefix)})


def random_boxes(
    n: int, seed: int, size: float = 1000.0, max_wh: float = 120.0, dtype: torch.dtype = torch.float32
) -> Tuple[Tensor, Tensor]:
    """n boxes [n, 4] with corners uniform in a size x size image and sides in [1, max_wh + 1),
    and scores [n] uniform in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * size
    wh = torch.rand(n, 2, generator=g) * max_wh + 1.0
    scores = torch.rand(n, generator=g)
    return torch.cat([xy, xy + wh], 1).to(dtype), scores.to(dtype)


def clustered_boxes(n: int, seed: int, clusters: int = 40, dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """RPN-like proposals: n boxes jittered around `clusters` objects, heavily overlapping."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.rand(clusters, 2, generator=g) * 800 + 100
    sizes = torch.rand(clusters, 2, generator=g) * 200 + 20
    which = torch.randint(0, clusters, (n,), generator=g)
    c = centers[which] + torch.randn(n, 2, generator=g) * sizes[which] * 0.1
    wh = sizes[which] * (1 + 0.2 * torch.randn(n, 2, generator=g)).clamp(min=0.2)
    boxes = torch.cat([c - wh / 2, c + wh / 2], 1)
    scores = torch.rand(n, generator=g)
    return boxes.to(dtype), scores.to(dtype)


def random_rois(
    k: int, batch: int, height: int, width: int, seed: int, spatial_scale: float = 1.0, dtype: torch.dtype = torch.float32
) -> Tensor:
    """k RoIs [k, 5] (batch index, x1, y1, x2, y2) in image coordinates of a feature map of
    height x width at spatial_scale, sides from 1/32 to 1/2 of the image."""
    g = torch.Generator().manual_seed(seed)
    img_h, img_w = height / spatial_scale, width / spatial_scale
    idx = torch.randint(0, batch, (k, 1), generator=g).to(torch.float32)
    wh = torch.rand(k, 2, generator=g) * torch.tensor([img_w, img_h]) * (0.5 - 1 / 32) + torch.tensor([img_w, img_h]) / 32
    xy = torch.rand(k, 2, generator=g) * (torch.tensor([img_w, img_h]) - wh)
    return torch.cat([idx, xy, xy + wh], 1).to(dtype)


def nudge_detector(model: torch.nn.Module) -> torch.nn.Module:
    """Make a randomly initialised torchvision Faster / Mask R-CNN give confident detections of
    several classes and masks that are not flat (in place; returns the model). The parity tests
    and the detector benchmark compare detops with torchvision on such a model."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        rpn = model.rpn.head
        rpn.cls_logits.weight.normal_(0, 0.05, generator=g)
        rpn.bbox_pred.weight.normal_(0, 0.02, generator=g)
        pred = model.roi_heads.box_predictor
        pred.cls_score.weight.normal_(0, 0.005, generator=g)
        pred.cls_score.bias[1:8] = torch.linspace(2.0, 3.5, 7)
        pred.bbox_pred.weight.normal_(0, 0.01, generator=g)
        mp = getattr(model.roi_heads, "mask_predictor", None)
        if mp is not None:
            mp.mask_fcn_logits.weight.mul_(20)
            mp.mask_fcn_logits.bias.normal_(0, 1, generator=g)
    return model
