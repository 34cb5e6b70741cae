"""RPN head: a shared 3x3 conv, then objectness logits and box deltas for every anchor."""
from __future__ import annotations

from typing import List, Tuple

from torch import Tensor, nn
from torch.nn import functional as F

from ..registry import RPN_HEADS


@RPN_HEADS.register("SingleConvRPNHead")
class RPNHead(nn.Module):
    """Args:
    in_channels (int): channels of the feature maps.
    num_anchors (int): anchors per location.

    forward(list of [B, C, H, W]) -> (objectness [B, A, H, W] per level, deltas [B, 4A, H, W] per level)
    """

    def __init__(self, in_channels: int, num_anchors: int):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, in_channels, 3, padding=1)
        self.cls_logits = nn.Conv2d(in_channels, num_anchors, 1)
        self.bbox_pred = nn.Conv2d(in_channels, num_anchors * 4, 1)
        for layer in (self.conv, self.cls_logits, self.bbox_pred):
            nn.init.normal_(layer.weight, std=0.01)
            nn.init.constant_(layer.bias, 0)

    def forward(self, features: List[Tensor]) -> Tuple[List[Tensor], List[Tensor]]:
        logits, deltas = [], []
        for f in features:
            t = F.relu(self.conv(f))
            logits.append(self.cls_logits(t))
            deltas.append(self.bbox_pred(t))
        return logits, deltas
