"""Detection ops, drop-in for their `torchvision.ops` namesakes."""
from .nms import batched_nms, nms

__all__ = ["nms", "batched_nms"]
