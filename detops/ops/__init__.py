"""Detection ops, drop-in for their `torchvision.ops` namesakes."""
from .nms import batched_nms, nms
from .nms_padded import nms_padded
from .poolers import MultiScaleRoIAlign
from .roi_align import RoIAlign, roi_align
from .roi_pool import RoIPool, roi_pool

__all__ = ["nms", "batched_nms", "nms_padded", "roi_align", "RoIAlign", "roi_pool", "RoIPool", "MultiScaleRoIAlign"]
