"""Backbone factory: MODEL.BACKBONE.CONV_BODY -> a registered builder."""
from __future__ import annotations

from torch import nn

from ..registry import BACKBONES
from .fpn import FPN, LastLevelMaxPool
from .resnet import ResNet


class BodyWithFPN(nn.Module):
    """A body (list of stage outputs) followed by an FPN; out_channels is the FPN's."""

    def __init__(self, body: nn.Module, fpn: FPN):
        super().__init__()
        self.body = body
        self.fpn = fpn
        self.out_channels = fpn.out_channels

    def forward(self, x):
        return self.fpn(self.body(x))


def _resnet_fpn(cfg, depth: int) -> nn.Module:
    r = cfg.MODEL.RESNETS
    body = ResNet(depth, freeze_at=cfg.MODEL.BACKBONE.FREEZE_CONV_BODY_AT, stride_in_1x1=r.STRIDE_IN_1X1,
                  num_groups=r.NUM_GROUPS, width_per_group=r.WIDTH_PER_GROUP,
                  stem_out_channels=r.STEM_OUT_CHANNELS, bn_eps=r.BN_EPS, norm=r.NORM)
    top = LastLevelMaxPool() if cfg.MODEL.FPN.USE_MAX_POOL_LEVEL else None
    fpn = FPN(body.out_channels, cfg.MODEL.FPN.OUT_CHANNELS, top_block=top)
    return BodyWithFPN(body, fpn)


for _depth in (18, 34, 50, 101):
    BACKBONES.register(f"R-{_depth}-FPN", lambda cfg, d=_depth: _resnet_fpn(cfg, d))


def build_backbone(cfg) -> nn.Module:
    """The backbone named by cfg.MODEL.BACKBONE.CONV_BODY; returns a module whose forward gives
    an OrderedDict of feature maps and that has an `out_channels` attribute."""
    return BACKBONES[cfg.MODEL.BACKBONE.CONV_BODY](cfg)
