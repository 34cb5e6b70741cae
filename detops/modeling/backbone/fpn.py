"""Feature Pyramid Network over the ResNet stages, with an extra max-pooled top level."""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List

from torch import Tensor, nn
from torch.nn import functional as F


class LastLevelMaxPool(nn.Module):
    """P6 = max_pool(P5, kernel 1, stride 2): the coarsest level the RPN uses."""

    def forward(self, x: Tensor) -> Tensor:
        return F.max_pool2d(x, kernel_size=1, stride=2, padding=0)


class FPN(nn.Module):
    """Top-down pathway with lateral 1x1 convs and 3x3 output convs.

    Args:
        in_channels_list (list[int]): channels of the body's outputs, finest first.
        out_channels (int): channels of every pyramid level.
        top_block (nn.Module or None): computes an extra level from the coarsest output.

    forward(list of [B, C_i, H_i, W_i], finest first) -> OrderedDict "0", "1", ... (and "pool").
    """

    def __init__(self, in_channels_list: List[int], out_channels: int, top_block: nn.Module = None):
        super().__init__()
        self.inner_blocks = nn.ModuleList()
        self.layer_blocks = nn.ModuleList()
        for cin in in_channels_list:
            self.inner_blocks.append(nn.Conv2d(cin, out_channels, 1))
            self.layer_blocks.append(nn.Conv2d(out_channels, out_channels, 3, padding=1))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_uniform_(m.weight, a=1)
                nn.init.constant_(m.bias, 0)
        self.top_block = top_block
        self.out_channels = out_channels

    def forward(self, xs: List[Tensor]) -> Dict[str, Tensor]:
        last_inner = self.inner_blocks[-1](xs[-1])
        results = [self.layer_blocks[-1](last_inner)]
        for idx in range(len(xs) - 2, -1, -1):
            lateral = self.inner_blocks[idx](xs[idx])
            top_down = F.interpolate(last_inner, size=lateral.shape[-2:], mode="nearest")
            last_inner = lateral + top_down
            results.insert(0, self.layer_blocks[idx](last_inner))
        names = [str(i) for i in range(len(results))]
        if self.top_block is not None:
            results.append(self.top_block(results[-1]))
            names.append("pool")
        return OrderedDict(zip(names, results))
