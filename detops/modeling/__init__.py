"""The GeneralizedRCNN detector (Faster / Mask R-CNN) on detops ops, built from a config.

    from detops.config import get_cfg
    from detops.modeling import build_detection_model

    cfg = get_cfg()
    cfg.merge_from_file("configs/e2e_mask_rcnn_R_50_FPN.yaml")
    model = build_detection_model(cfg).eval()
    detections = model([image])        # image: float RGB [3, H, W] in [0, 1]
"""
from .backbone import build_backbone
from .detector import GeneralizedRCNN, build_detection_model
from .registry import Registry
from .roi_heads import build_roi_heads
from .rpn import build_rpn
from .torchvision_compat import (
    from_torchvision,
    from_torchvision_state_dict,
    torchvision_cfg,
    torchvision_key_to_detops,
    torchvision_state_dict_to_detops,
)

__all__ = [
    "GeneralizedRCNN", "Registry", "build_backbone", "build_detection_model", "build_roi_heads", "build_rpn",
    "from_torchvision", "from_torchvision_state_dict", "torchvision_cfg", "torchvision_key_to_detops",
    "torchvision_state_dict_to_detops",
]
