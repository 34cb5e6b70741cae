"""Detection ops, drop-in for their `torchvision.ops` namesakes."""
from .nms import batched_nms, nms
from .roi_align import RoIAlign, roi_align

__all__ = ["nms", "batched_nms", "roi_align", "RoIAlign"]
