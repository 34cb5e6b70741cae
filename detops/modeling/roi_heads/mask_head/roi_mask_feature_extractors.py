"""Mask-head feature extractors: 14x14 pooled RoI features -> a small FCN."""
from __future__ import annotations

from typing import Dict, List, Tuple

from torch import Tensor, nn
from torch.nn import functional as F

from ...poolers import make_pooler
from ...registry import ROI_MASK_FEATURE_EXTRACTORS


@ROI_MASK_FEATURE_EXTRACTORS.register("MaskRCNNFPNFeatureExtractor")
class MaskRCNNFPNFeatureExtractor(nn.Module):
    """Multi-scale RoIAlign (POOLER_RESOLUTION, 14) then 3x3 conv + ReLU layers
    (mask_fcn1..N, widths CONV_LAYERS)."""

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        head = cfg.MODEL.ROI_MASK_HEAD
        self.pooler = make_pooler(head)
        self.blocks = []
        cin = in_channels
        for i, cout in enumerate(head.CONV_LAYERS, 1):
            conv = nn.Conv2d(cin, cout, 3, padding=head.DILATION, dilation=head.DILATION)
            nn.init.kaiming_normal_(conv.weight, mode="fan_out", nonlinearity="relu")
            nn.init.constant_(conv.bias, 0)
            self.add_module(f"mask_fcn{i}", conv)
            self.blocks.append(f"mask_fcn{i}")
            cin = cout
        self.out_channels = cin

    def forward(self, features: Dict[str, Tensor], boxes: List[Tensor], image_sizes: List[Tuple[int, int]]) -> Tensor:
        x = self.pooler(features, boxes, image_sizes)
        for name in self.blocks:
            x = F.relu(getattr(self, name)(x))
        return x
