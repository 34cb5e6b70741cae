"""Load torchvision's Faster / Mask R-CNN (ResNet-50-FPN, v1) weights into a detops model.

    import torchvision
    from detops.modeling import from_torchvision, from_torchvision_state_dict

    tv = torchvision.models.detection.maskrcnn_resnet50_fpn(weights="DEFAULT")
    model = from_torchvision(tv).eval()             # same detections as tv.eval()

    model = from_torchvision_state_dict("maskrcnn_resnet50_fpn_coco.pth", mask=True)

The config is set to torchvision's input and post-processing settings; `torchvision_state_dict_to_detops`
is the key mapping (it accepts the current and the older torchvision key layouts).
"""
from __future__ import annotations

import re
from typing import Dict, Optional, Union

import torch
from torch import Tensor, nn

from ..config import get_cfg
from .detector import build_detection_model

# torchvision key -> detops key; applied in order, first match wins.
_KEY_RULES = [
    (r"^backbone\.body\.conv1\.", "backbone.body.stem.conv1."),
    (r"^backbone\.body\.bn1\.", "backbone.body.stem.bn1."),
    (r"^backbone\.body\.(layer\d\..*)$", r"backbone.body.\1"),
    (r"^backbone\.fpn\.(inner_blocks|layer_blocks)\.(\d+)\.(?:0\.)?(weight|bias)$", r"backbone.fpn.\1.\2.\3"),
    (r"^rpn\.head\.conv\.(?:0\.0\.)?(weight|bias)$", r"rpn.head.conv.\1"),
    (r"^rpn\.head\.(cls_logits|bbox_pred)\.", r"rpn.head.\1."),
    (r"^roi_heads\.box_head\.(fc6|fc7)\.", r"roi_heads.box.feature_extractor.\1."),
    (r"^roi_heads\.box_predictor\.(cls_score|bbox_pred)\.", r"roi_heads.box.predictor.\1."),
    (r"^roi_heads\.mask_head\.mask_fcn(\d)\.", r"roi_heads.mask.feature_extractor.mask_fcn\1."),
    (r"^roi_heads\.mask_predictor\.(conv5_mask|mask_fcn_logits)\.", r"roi_heads.mask.predictor.\1."),
]


def _mask_head_key(key: str) -> Optional[str]:
    # current layout: roi_heads.mask_head.<i>.0.weight (Conv2dNormActivation), i from 0
    m = re.match(r"^roi_heads\.mask_head\.(\d+)\.0\.(weight|bias)$", key)
    if m:
        return f"roi_heads.mask.feature_extractor.mask_fcn{int(m.group(1)) + 1}.{m.group(2)}"
    return None


def torchvision_key_to_detops(key: str) -> Optional[str]:
    """The detops name of a torchvision detection state_dict key (None: no counterpart,
    e.g. BatchNorm's num_batches_tracked)."""
    if key.endswith("num_batches_tracked"):
        return None
    mapped = _mask_head_key(key)
    if mapped is not None:
        return mapped
    for pattern, repl in _KEY_RULES:
        if re.match(pattern, key):
            return re.sub(pattern, repl, key)
    raise KeyError(f"from_torchvision: no detops counterpart for torchvision key {key!r}")


def torchvision_state_dict_to_detops(state_dict: Dict[str, Tensor]) -> Dict[str, Tensor]:
    out = {}
    for k, v in state_dict.items():
        nk = torchvision_key_to_detops(k)
        if nk is not None:
            out[nk] = v
    return out


def torchvision_cfg(mask: bool = True, num_classes: int = 91, min_size: int = 800, max_size: int = 1333,
                    image_mean=(0.485, 0.456, 0.406), image_std=(0.229, 0.224, 0.225)):
    """The config of torchvision's {mask,faster}rcnn_resnet50_fpn with its default settings."""
    cfg = get_cfg()
    cfg.merge_from_list([
        "MODEL.MASK_ON", mask,
        "MODEL.BACKBONE.CONV_BODY", "R-50-FPN",
        "MODEL.RESNETS.STRIDE_IN_1X1", False,
        "MODEL.RESNETS.BN_EPS", 1e-5,
        "MODEL.RPN.INFER_ANCHOR_STRIDE", True,
        "MODEL.RPN.MIN_SIZE", 1e-3,
        "MODEL.RPN.SCORE_THRESH", 0.0,
        "MODEL.ROI_HEADS.MIN_SIZE", 1e-2,
        "MODEL.ROI_BOX_HEAD.NUM_CLASSES", num_classes,
        "INPUT.MIN_SIZE_TRAIN", (min_size,),
        "INPUT.MAX_SIZE_TRAIN", max_size,
        "INPUT.MIN_SIZE_TEST", min_size,
        "INPUT.MAX_SIZE_TEST", max_size,
        "INPUT.PIXEL_MEAN", list(image_mean),
        "INPUT.PIXEL_STD", list(image_std),
        "INPUT.TO_BGR255", False,
        "MODEL.ROI_MASK_HEAD.POSTPROCESS_MASKS_THRESHOLD", -1.0,
    ])
    return cfg


def _cfg_from_tv_model(tv_model: nn.Module):
    t = tv_model.transform
    rpn = tv_model.rpn
    rh = tv_model.roi_heads
    mask = getattr(rh, "mask_predictor", None) is not None
    num_classes = rh.box_predictor.cls_score.out_features
    cfg = torchvision_cfg(mask=mask, num_classes=num_classes, min_size=t.min_size[-1], max_size=t.max_size,
                          image_mean=t.image_mean, image_std=t.image_std)
    ag = rpn.anchor_generator
    sizes = [s[0] for s in ag.sizes]
    if any(len(s) != 1 for s in ag.sizes) or any(tuple(a) != tuple(ag.aspect_ratios[0]) for a in ag.aspect_ratios):
        raise ValueError("from_torchvision: only one anchor size per level and the same aspect ratios on every level are supported")
    cfg.merge_from_list([
        "INPUT.MIN_SIZE_TRAIN", tuple(t.min_size),
        "DATALOADER.SIZE_DIVISIBILITY", t.size_divisible,
        "MODEL.RPN.ANCHOR_SIZES", tuple(sizes),
        "MODEL.RPN.ASPECT_RATIOS", tuple(float(a) for a in ag.aspect_ratios[0]),
        "MODEL.RPN.PRE_NMS_TOP_N_TRAIN", rpn._pre_nms_top_n["training"],
        "MODEL.RPN.PRE_NMS_TOP_N_TEST", rpn._pre_nms_top_n["testing"],
        "MODEL.RPN.FPN_POST_NMS_TOP_N_TRAIN", rpn._post_nms_top_n["training"],
        "MODEL.RPN.FPN_POST_NMS_TOP_N_TEST", rpn._post_nms_top_n["testing"],
        "MODEL.RPN.NMS_THRESH", rpn.nms_thresh,
        "MODEL.RPN.SCORE_THRESH", rpn.score_thresh,
        "MODEL.RPN.MIN_SIZE", rpn.min_size,
        "MODEL.RPN.FG_IOU_THRESHOLD", rpn.proposal_matcher.high_threshold,
        "MODEL.RPN.BG_IOU_THRESHOLD", rpn.proposal_matcher.low_threshold,
        "MODEL.RPN.BATCH_SIZE_PER_IMAGE", rpn.fg_bg_sampler.batch_size_per_image,
        "MODEL.RPN.POSITIVE_FRACTION", rpn.fg_bg_sampler.positive_fraction,
        "MODEL.ROI_HEADS.SCORE_THRESH", rh.score_thresh,
        "MODEL.ROI_HEADS.NMS", rh.nms_thresh,
        "MODEL.ROI_HEADS.DETECTIONS_PER_IMG", rh.detections_per_img,
        "MODEL.ROI_HEADS.FG_IOU_THRESHOLD", rh.proposal_matcher.high_threshold,
        "MODEL.ROI_HEADS.BG_IOU_THRESHOLD", rh.proposal_matcher.low_threshold,
        "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", rh.fg_bg_sampler.batch_size_per_image,
        "MODEL.ROI_HEADS.POSITIVE_FRACTION", rh.fg_bg_sampler.positive_fraction,
        "MODEL.ROI_HEADS.BBOX_REG_WEIGHTS", tuple(float(w) for w in rh.box_coder.weights),
    ])
    return cfg


def from_torchvision(tv_model: nn.Module, cfg=None) -> nn.Module:
    """A detops GeneralizedRCNN with the config (input size, normalisation, RPN and RoI-head
    settings) and the weights of a torchvision maskrcnn_resnet50_fpn / fasterrcnn_resnet50_fpn
    model. Its train/eval mode follows tv_model's; it is on tv_model's device."""
    if cfg is None:
        cfg = _cfg_from_tv_model(tv_model)
    device = next(tv_model.parameters()).device
    cfg.MODEL.DEVICE = str(device)
    model = build_detection_model(cfg)
    model.load_state_dict(torchvision_state_dict_to_detops(tv_model.state_dict()))
    return model.train(tv_model.training)


def from_torchvision_state_dict(path_or_dict: Union[str, Dict[str, Tensor]], mask: bool = True,
                                num_classes: Optional[int] = None, cfg=None) -> nn.Module:
    """A detops model (torchvision's default settings, eval mode, CPU) from a torchvision
    {mask,faster}rcnn_resnet50_fpn state_dict or the path of one saved with torch.save."""
    state = path_or_dict
    if not isinstance(state, dict):
        state = torch.load(path_or_dict, map_location="cpu", weights_only=True)
    if num_classes is None:
        num_classes = state["roi_heads.box_predictor.cls_score.weight"].shape[0]
    if cfg is None:
        cfg = torchvision_cfg(mask=mask, num_classes=num_classes)
    if not mask:
        state = {k: v for k, v in state.items() if not k.startswith(("roi_heads.mask_head", "roi_heads.mask_predictor"))}
    model = build_detection_model(cfg)
    model.load_state_dict(torchvision_state_dict_to_detops(state))
    return model.eval()
