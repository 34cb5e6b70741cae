"""BatchNorm2d with fixed statistics and affine parameters (buffers, not parameters)."""
from __future__ import annotations

import torch
from torch import Tensor, nn


class FrozenBatchNorm2d(nn.Module):
    """y = (x - running_mean) / sqrt(running_var + eps) * weight + bias, nothing trained.

    Keeps the four buffers of nn.BatchNorm2d (weight, bias, running_mean, running_var), so
    BatchNorm checkpoints load directly (num_batches_tracked is dropped).
    """

    def __init__(self, num_features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(num_features))
        self.register_buffer("bias", torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        state_dict.pop(prefix + "num_batches_tracked", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)

    def forward(self, x: Tensor) -> Tensor:
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + self.eps).rsqrt()
        shift = self.bias.reshape(1, -1, 1, 1) - self.running_mean.reshape(1, -1, 1, 1) * scale
        # one pass over x (shift + x * scale), instead of a multiply and then an add
        return torch.addcmul(shift, x, scale)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
