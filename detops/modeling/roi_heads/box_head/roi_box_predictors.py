"""Box predictors: RoI feature vector -> class logits and class-specific box deltas."""
from __future__ import annotations

from typing import Tuple

from torch import Tensor, nn

from ...registry import ROI_BOX_PREDICTOR


@ROI_BOX_PREDICTOR.register("FPNPredictor")
class FPNPredictor(nn.Module):
    """cls_score: Linear -> [R, num_classes]; bbox_pred: Linear -> [R, num_classes * 4]."""

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        num_classes = cfg.MODEL.ROI_BOX_HEAD.NUM_CLASSES
        self.cls_score = nn.Linear(in_channels, num_classes)
        self.bbox_pred = nn.Linear(in_channels, num_classes * 4)
        nn.init.normal_(self.cls_score.weight, std=0.01)
        nn.init.normal_(self.bbox_pred.weight, std=0.001)
        nn.init.constant_(self.cls_score.bias, 0)
        nn.init.constant_(self.bbox_pred.bias, 0)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        x = x.flatten(start_dim=1)
        return self.cls_score(x), self.bbox_pred(x)
