"""ResNet bodies (18, 34, 50, 101), returning the outputs of res2..res5.

The normalisation layer is FrozenBatchNorm2d by default (pretrained weights); "BN" (trainable
BatchNorm2d) and "GN" (GroupNorm, 32 groups) let a body train from random initialisation."""
from __future__ import annotations

from typing import List

from torch import Tensor, nn
from torch.nn import functional as F

from .frozen_batch_norm import FrozenBatchNorm2d

NORMS = ("FrozenBN", "BN", "GN")


def make_norm(kind: str, channels: int, eps: float) -> nn.Module:
    """The normalisation layer named `kind` ("FrozenBN", "BN" or "GN") for `channels` channels."""
    if kind == "FrozenBN":
        return FrozenBatchNorm2d(channels, eps)
    if kind == "BN":
        return nn.BatchNorm2d(channels, eps=eps if eps > 0 else 1e-5)
    if kind == "GN":
        return nn.GroupNorm(min(32, channels), channels, eps=eps if eps > 0 else 1e-5)
    raise ValueError(f"ResNet: MODEL.RESNETS.NORM must be one of {NORMS}, got {kind!r}")

# depth -> (block kind, blocks per stage)
RESNET_SPECS = {
    18: ("basic", (2, 2, 2, 2)),
    34: ("basic", (3, 4, 6, 3)),
    50: ("bottleneck", (3, 4, 6, 3)),
    101: ("bottleneck", (3, 4, 23, 3)),
}


def _conv(cin: int, cout: int, k: int, stride: int = 1, dilation: int = 1, groups: int = 1) -> nn.Conv2d:
    pad = dilation * (k // 2)
    return nn.Conv2d(cin, cout, k, stride=stride, padding=pad, dilation=dilation, groups=groups, bias=False)


class _Downsample(nn.Sequential):
    """1x1 strided conv + norm on the shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, eps: float, norm: str = "FrozenBN"):
        super().__init__(_conv(cin, cout, 1, stride), make_norm(norm, cout, eps))


class BasicBlock(nn.Module):
    """Two 3x3 convs (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int, eps: float, norm: str = "FrozenBN", **_):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv(cin, width, 3, stride)
        self.bn1 = make_norm(norm, width, eps)
        self.conv2 = _conv(width, cout, 3)
        self.bn2 = make_norm(norm, cout, eps)
        self.downsample = _Downsample(cin, cout, stride, eps, norm) if stride != 1 or cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu_(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu_(out + identity)


class Bottleneck(nn.Module):
    """1x1 -> 3x3 -> 1x1 convs (ResNet-50/101). The stride sits in the 3x3 conv (torchvision,
    "ResNet v1.5") or, with stride_in_1x1, in the first 1x1 conv (MSRA / maskrcnn-benchmark)."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int, eps: float, groups: int = 1,
                 width_per_group: int = 64, stride_in_1x1: bool = False, norm: str = "FrozenBN"):
        super().__init__()
        inner = int(width * (width_per_group / 64.0)) * groups
        cout = width * self.expansion
        s1, s3 = (stride, 1) if stride_in_1x1 else (1, stride)
        self.conv1 = _conv(cin, inner, 1, s1)
        self.bn1 = make_norm(norm, inner, eps)
        self.conv2 = _conv(inner, inner, 3, s3, groups=groups)
        self.bn2 = make_norm(norm, inner, eps)
        self.conv3 = _conv(inner, cout, 1)
        self.bn3 = make_norm(norm, cout, eps)
        self.downsample = _Downsample(cin, cout, stride, eps, norm) if stride != 1 or cin != cout else None

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu_(self.bn1(self.conv1(x)))
        out = F.relu_(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu_(out + identity)


class StemWithFixedBatchNorm(nn.Module):
    """7x7 stride-2 conv, norm (frozen BN by default), ReLU, 3x3 stride-2 max pool: stride 4 overall."""

    def __init__(self, out_channels: int, eps: float, norm: str = "FrozenBN"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, out_channels, 7, stride=2, padding=3, bias=False)
        self.bn1 = make_norm(norm, out_channels, eps)

    def forward(self, x: Tensor) -> Tensor:
        x = F.relu_(self.bn1(self.conv1(x)))
        return F.max_pool2d(x, kernel_size=3, stride=2, padding=1)


class ResNet(nn.Module):
    """ResNet body: stem + 4 stages (res2..res5 = layer1..layer4), returning every stage's output.

    Args:
        depth (int): 18, 34, 50 or 101.
        freeze_at (int): stages frozen (requires_grad False): 0 none, 1 stem, 2 stem + res2, ...
        stride_in_1x1, num_groups, width_per_group: bottleneck variants.
        stem_out_channels (int): width of the stem (64).
        bn_eps (float): BatchNorm epsilon.
        norm (str): "FrozenBN" (default), "BN" or "GN".
    """

    def __init__(self, depth: int, freeze_at: int = 2, stride_in_1x1: bool = False, num_groups: int = 1,
                 width_per_group: int = 64, stem_out_channels: int = 64, bn_eps: float = 1e-5,
                 norm: str = "FrozenBN"):
        super().__init__()
        if depth not in RESNET_SPECS:
            raise ValueError(f"ResNet: depth must be one of {sorted(RESNET_SPECS)}, got {depth}")
        if norm not in NORMS:
            raise ValueError(f"ResNet: MODEL.RESNETS.NORM must be one of {NORMS}, got {norm!r}")
        kind, blocks = RESNET_SPECS[depth]
        block = BasicBlock if kind == "basic" else Bottleneck
        self.stem = StemWithFixedBatchNorm(stem_out_channels, bn_eps, norm)
        cin = stem_out_channels
        self.out_channels: List[int] = []
        for i, n in enumerate(blocks):
            width = 64 * 2 ** i
            layers = []
            for j in range(n):
                stride = 2 if (j == 0 and i > 0) else 1
                layers.append(block(cin, width, stride, bn_eps, groups=num_groups,
                                    width_per_group=width_per_group, stride_in_1x1=stride_in_1x1, norm=norm))
                cin = width * block.expansion
            self.add_module(f"layer{i + 1}", nn.Sequential(*layers))
            self.out_channels.append(cin)
        self._init_weights()
        self._freeze(freeze_at)

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _freeze(self, freeze_at: int) -> None:
        stages = [self.stem] + [getattr(self, f"layer{i}") for i in range(1, 5)]
        for stage in stages[:freeze_at]:
            for p in stage.parameters():
                p.requires_grad_(False)

    def forward(self, x: Tensor) -> List[Tensor]:
        x = self.stem(x)
        outs = []
        for i in range(1, 5):
            x = getattr(self, f"layer{i}")(x)
            outs.append(x)
        return outs
