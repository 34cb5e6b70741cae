"""Box regression targets: encode (reference boxes, targets) -> deltas, decode deltas -> boxes.

Deltas are (dx, dy, dw, dh) * weights, with dx = (gx - px) / pw and dw = log(gw / pw); centres
are x1 + 0.5 * w and widths x2 - x1. Decoded dw, dh are clamped at log(1000 / 16) so that exp
cannot overflow.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import Tensor

DEFAULT_BBOX_XFORM_CLIP = math.log(1000.0 / 16)


class BoxCoder:
    """Args:
    weights ((wx, wy, ww, wh)): scale of each delta component.
    bbox_xform_clip (float): upper bound of dw, dh before exp.
    """

    def __init__(self, weights: Tuple[float, float, float, float], bbox_xform_clip: float = DEFAULT_BBOX_XFORM_CLIP):
        self.weights = tuple(float(w) for w in weights)
        self.bbox_xform_clip = bbox_xform_clip

    def encode(self, reference_boxes: Tensor, proposals: Tensor) -> Tensor:
        """Deltas [N, 4] that turn `proposals` [N, 4] into `reference_boxes` [N, 4]."""
        wx, wy, ww, wh = self.weights
        ex_w = proposals[:, 2] - proposals[:, 0]
        ex_h = proposals[:, 3] - proposals[:, 1]
        ex_cx = proposals[:, 0] + 0.5 * ex_w
        ex_cy = proposals[:, 1] + 0.5 * ex_h
        gt_w = reference_boxes[:, 2] - reference_boxes[:, 0]
        gt_h = reference_boxes[:, 3] - reference_boxes[:, 1]
        gt_cx = reference_boxes[:, 0] + 0.5 * gt_w
        gt_cy = reference_boxes[:, 1] + 0.5 * gt_h
        dx = wx * (gt_cx - ex_cx) / ex_w
        dy = wy * (gt_cy - ex_cy) / ex_h
        dw = ww * torch.log(gt_w / ex_w)
        dh = wh * torch.log(gt_h / ex_h)
        return torch.stack((dx, dy, dw, dh), dim=1)

    def decode(self, rel_codes: Tensor, boxes: Tensor) -> Tensor:
        """Boxes from deltas.

        Args:
            rel_codes (Tensor[N, 4 * K]): deltas, K boxes per reference box (e.g. per class).
            boxes (Tensor[N, 4]): reference boxes.
        Returns:
            Tensor[N, 4 * K]: decoded x1, y1, x2, y2 (K groups of four).
        """
        if rel_codes.dtype in (torch.float16, torch.bfloat16):  # autocast: decode in float32
            rel_codes = rel_codes.float()
        boxes = boxes.to(rel_codes.dtype)
        wx, wy, ww, wh = self.weights
        widths = boxes[:, 2] - boxes[:, 0]
        heights = boxes[:, 3] - boxes[:, 1]
        ctr_x = boxes[:, 0] + 0.5 * widths
        ctr_y = boxes[:, 1] + 0.5 * heights

        dx = rel_codes[:, 0::4] / wx
        dy = rel_codes[:, 1::4] / wy
        dw = torch.clamp(rel_codes[:, 2::4] / ww, max=self.bbox_xform_clip)
        dh = torch.clamp(rel_codes[:, 3::4] / wh, max=self.bbox_xform_clip)

        pred_ctr_x = dx * widths[:, None] + ctr_x[:, None]
        pred_ctr_y = dy * heights[:, None] + ctr_y[:, None]
        pred_w = torch.exp(dw) * widths[:, None]
        pred_h = torch.exp(dh) * heights[:, None]
        half_w = pred_w * 0.5  # exact in every float format, and no host-to-device copy
        half_h = pred_h * 0.5
        pred = torch.stack(
            (pred_ctr_x - half_w, pred_ctr_y - half_h, pred_ctr_x + half_w, pred_ctr_y + half_h), dim=2
        )
        return pred.flatten(1)
