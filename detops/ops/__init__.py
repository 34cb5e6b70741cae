"""Detection ops, drop-in for their `torchvision.ops` namesakes."""
from .nms import batched_nms, nms
from .roi_pool import RoIPool, roi_pool

__all__ = ["nms", "batched_nms", "roi_pool", "RoIPool"]
