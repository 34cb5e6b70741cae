from .backbone import build_backbone
from .frozen_batch_norm import FrozenBatchNorm2d
from .fpn import FPN, LastLevelMaxPool
from .resnet import ResNet

__all__ = ["build_backbone", "FrozenBatchNorm2d", "FPN", "LastLevelMaxPool", "ResNet"]
