"""Box-head feature extractors: pooled RoI features -> one vector per RoI."""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor, nn
from torch.nn import functional as F

from ...poolers import make_pooler
from ...registry import ROI_BOX_FEATURE_EXTRACTORS


@ROI_BOX_FEATURE_EXTRACTORS.register("FPN2MLPFeatureExtractor")
class FPN2MLPFeatureExtractor(nn.Module):
    """Multi-scale RoIAlign (7x7) followed by two fully connected layers with ReLU (fc6, fc7)."""

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        head = cfg.MODEL.ROI_BOX_HEAD
        self.pooler = make_pooler(head)
        res = head.POOLER_RESOLUTION
        self.fc6 = nn.Linear(in_channels * res * res, head.MLP_HEAD_DIM)
        self.fc7 = nn.Linear(head.MLP_HEAD_DIM, head.MLP_HEAD_DIM)
        self.out_channels = head.MLP_HEAD_DIM

    def forward(self, features: Dict[str, Tensor], boxes: List[Tensor], image_sizes: List[Tuple[int, int]]) -> Tensor:
        x = self.pooler(features, boxes, image_sizes).flatten(start_dim=1)
        return F.relu(self.fc7(F.relu(self.fc6(x))))
