from .roi_heads import CombinedROIHeads, build_roi_heads

__all__ = ["CombinedROIHeads", "build_roi_heads"]
