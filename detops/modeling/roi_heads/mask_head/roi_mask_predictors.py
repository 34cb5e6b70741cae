"""Mask predictors: FCN features -> per-class mask logits at twice the pooled resolution."""
from __future__ import annotations

from torch import Tensor, nn
from torch.nn import functional as F

from ...registry import ROI_MASK_PREDICTOR


@ROI_MASK_PREDICTOR.register("MaskRCNNC4Predictor")
class MaskRCNNC4Predictor(nn.Module):
    """2x2 stride-2 transposed conv + ReLU (conv5_mask), then a 1x1 conv to one logit map per
    class (mask_fcn_logits): [R, C, 14, 14] -> [R, num_classes, 28, 28]."""

    def __init__(self, cfg, in_channels: int):
        super().__init__()
        num_classes = cfg.MODEL.ROI_BOX_HEAD.NUM_CLASSES
        dim = cfg.MODEL.ROI_MASK_HEAD.CONV_LAYERS[-1]
        self.conv5_mask = nn.ConvTranspose2d(in_channels, dim, 2, 2, 0)
        self.mask_fcn_logits = nn.Conv2d(dim, num_classes, 1, 1, 0)
        for m in (self.conv5_mask, self.mask_fcn_logits):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.constant_(m.bias, 0)

    def forward(self, x: Tensor) -> Tensor:
        return self.mask_fcn_logits(F.relu(self.conv5_mask(x)))
