"""GeneralizedRCNN: backbone + RPN + RoI heads."""
from __future__ import annotations

from typing import Dict, List, Optional, Union

import torch
from torch import Tensor, nn

from ...structures import BoxList
from ..backbone import build_backbone
from ..cuda_graph import GraphedTraining
from ..registry import META_ARCH_REGISTRY
from ..roi_heads import build_roi_heads
from ..rpn import build_rpn
from ..transform import build_transform, check_targets
from ..utils import pad_targets


MEMORY_FORMATS = ("auto", "channels_last", "contiguous")


@META_ARCH_REGISTRY.register("GeneralizedRCNN")
class GeneralizedRCNN(nn.Module):
    """Faster / Mask R-CNN.

    forward(images, targets=None):
        images (list[Tensor[3, H_i, W_i]]): float RGB in [0, 1], any sizes; the model normalises,
            resizes (INPUT.MIN_SIZE_*/MAX_SIZE_*) and pads them itself.
        targets (list[dict] or list[BoxList], training only): per image "boxes" [N, 4] (x1, y1,
            x2, y2 in input pixels), "labels" [N] int64 (1..NUM_CLASSES-1) and, for Mask R-CNN,
            "masks" [N, H, W] uint8.
    Returns:
        training: dict of losses (loss_objectness, loss_rpn_box_reg, loss_classifier,
        loss_box_reg, loss_mask).
        eval: list (one per image) of dicts with "boxes" [K, 4], "labels" [K], "scores" [K] and,
        with masks, "masks" [K, 1, H, W] (probabilities), in the input images' coordinates.

    With MODEL.MEMORY_FORMAT "channels_last" (or "auto" on a CUDA input) the model runs its
    convolutions in channels_last: the first such forward converts the 4-d weights in place,
    the FPN levels come out channels_last and the RoI poolers read them without a copy.
    Otherwise the weights are kept (or put back) in the contiguous layout.

    On CUDA, training iterations with a repeating input shape run the backbone through CUDA
    graphs (MODEL.BACKBONE.CUDA_GRAPHS, `backbone_graphs`), with the same losses and gradients.
    In training the RPN and RoI heads work in fixed shapes (gt padded to a multiple of 8 boxes
    per image, padded proposals, sampled slots with a "valid" field), so after the target check
    the host never waits for the GPU except for the mask head's positive counts, which are
    copied while earlier work still runs. On CUDA the work that needs no gradients (proposals,
    matching, sampling, target encoding) replays CUDA graphs as well (MODEL.TARGETS_CUDA_GRAPHS).
    """

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg.clone()
        self.transform = build_transform(cfg)
        self.backbone = build_backbone(cfg)
        self.rpn = build_rpn(cfg, self.backbone.out_channels)
        self.roi_heads = build_roi_heads(cfg, self.backbone.out_channels)
        self.mask_threshold = cfg.MODEL.ROI_MASK_HEAD.POSTPROCESS_MASKS_THRESHOLD
        if cfg.MODEL.MEMORY_FORMAT not in MEMORY_FORMATS:
            raise ValueError(
                f"GeneralizedRCNN: MODEL.MEMORY_FORMAT must be one of {MEMORY_FORMATS}, got {cfg.MODEL.MEMORY_FORMAT!r}")
        self.memory_format = cfg.MODEL.MEMORY_FORMAT
        b = cfg.MODEL.BACKBONE
        self.backbone_graphs = GraphedTraining(max_graphs=b.CUDA_GRAPHS, after=b.CUDA_GRAPH_AFTER)

    def channels_last(self, device: torch.device) -> bool:
        """Whether the convolutions run in channels_last on `device` (MODEL.MEMORY_FORMAT)."""
        return self.memory_format == "channels_last" or (self.memory_format == "auto" and device.type == "cuda")

    def _convert_weights(self, fmt: torch.memory_format) -> None:
        """Give every 4-d weight the layout `fmt` (in place: parameters keep their identity, so
        optimizers and hooks still see them). Nothing to do when the layout is already right."""
        for m in self.modules():
            w = getattr(m, "weight", None)
            if isinstance(w, Tensor) and w.dim() == 4 and not w.is_contiguous(memory_format=fmt):
                with torch.no_grad():
                    w.data = w.data.contiguous(memory_format=fmt)
                    if w.grad is not None:
                        w.grad.data = w.grad.data.contiguous(memory_format=fmt)

    def forward(self, images: List[Tensor], targets: Optional[List[Union[Dict[str, Tensor], BoxList]]] = None):
        if self.training:
            if targets is None:
                raise ValueError("GeneralizedRCNN: targets are needed in training mode")
            if len(targets) != len(images):
                raise ValueError(f"GeneralizedRCNN: {len(images)} images but {len(targets)} targets")
            check_targets(targets)
        original_sizes = [tuple(img.shape[-2:]) for img in images]
        image_list, boxlists = self.transform(images, targets if self.training else None)
        x = image_list.tensors
        if self.channels_last(x.device):
            self._convert_weights(torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        else:
            self._convert_weights(torch.contiguous_format)
        graphs = self.__dict__.get("backbone_graphs")  # absent from models pickled before it existed
        features = graphs(self.backbone, x) if graphs is not None else self.backbone(x)
        padded = pad_targets(boxlists) if self.training else None
        proposals, losses = self.rpn(image_list, features, boxlists, padded)
        if self.roi_heads is None:
            detections = proposals
            for p in detections:
                p.add_field("scores", p.get_field("objectness"))
                p.add_field("labels", p.bbox.new_ones(len(p), dtype=torch.int64))
        else:
            detections, head_losses = self.roi_heads(features, proposals, image_list.image_sizes, boxlists, padded)
            losses.update(head_losses)
        if self.training:
            return losses
        return self.transform.postprocess(detections, image_list.image_sizes, original_sizes, self.mask_threshold)

