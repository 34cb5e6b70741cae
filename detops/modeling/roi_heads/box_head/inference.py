"""Box-head post-processing: class-specific boxes, score threshold, per-class NMS, top-k.

Every image and class goes through one `detops.ops.batched_nms` call (category =
image_index * num_classes + class), with no Python loop over images or classes.
"""
from __future__ import annotations

from typing import List

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ....ops import batched_nms
from ....structures import BoxList
from ...box_coder import BoxCoder
from ...utils import top_k_per_group


class PostProcessor(nn.Module):
    """Args:
    score_thresh (float): detections scoring at most this are dropped.
    nms (float): IoU threshold of the per-class NMS.
    detections_per_img (int): detections kept per image (highest scores).
    min_size (float): detections narrower or shorter than this are dropped.
    box_coder (BoxCoder): decodes the class-specific deltas.
    """

    def __init__(self, score_thresh: float, nms: float, detections_per_img: int, min_size: float, box_coder: BoxCoder):
        super().__init__()
        self.score_thresh = score_thresh
        self.nms = nms
        self.detections_per_img = detections_per_img
        self.min_size = min_size
        self.box_coder = box_coder

    def forward(self, class_logits: Tensor, box_regression: Tensor, proposals: List[BoxList]) -> List[BoxList]:
        """class_logits [R, C], box_regression [R, 4C], proposals of each image (R in total)
        -> detections of each image: BoxList with "scores" and "labels" (1..C-1)."""
        device = class_logits.device
        num_classes = class_logits.shape[-1]
        num_images = len(proposals)
        counts = [len(p) for p in proposals]
        boxes = self.box_coder.decode(box_regression, torch.cat([p.bbox for p in proposals], 0))
        boxes = boxes.reshape(-1, num_classes, 4)
        scores = F.softmax(class_logits, -1)

        image_ids = torch.repeat_interleave(torch.arange(num_images, device=device),
                                            torch.tensor(counts, device=device))
        sizes = torch.tensor([p.size for p in proposals], dtype=boxes.dtype, device=device).reshape(-1, 2)  # (w, h)
        wh = sizes[image_ids]
        x = torch.minimum(boxes[..., 0::2].clamp(min=0), wh[:, 0].view(-1, 1, 1))
        y = torch.minimum(boxes[..., 1::2].clamp(min=0), wh[:, 1].view(-1, 1, 1))
        boxes = torch.stack((x, y), dim=-1).reshape(-1, num_classes, 4)

        labels = torch.arange(num_classes, device=device).view(1, -1).expand_as(scores)
        boxes = boxes[:, 1:].reshape(-1, 4)
        scores = scores[:, 1:].reshape(-1)
        labels = labels[:, 1:].reshape(-1)
        image_ids = image_ids[:, None].expand(-1, num_classes - 1).reshape(-1)

        ws, hs = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        valid = torch.where((scores > self.score_thresh) & (ws >= self.min_size) & (hs >= self.min_size))[0]
        groups = image_ids * num_classes + labels
        keep = valid[batched_nms(boxes[valid], scores[valid], groups[valid], self.nms)]
        keep, kept_counts = top_k_per_group(image_ids, keep, self.detections_per_img, num_images)

        results = []
        for p, b, s, l in zip(proposals, boxes[keep].split(kept_counts), scores[keep].split(kept_counts),
                              labels[keep].split(kept_counts)):
            bl = BoxList(b, p.size, mode="xyxy")
            bl.add_field("scores", s)
            bl.add_field("labels", l)
            results.append(bl)
        return results


def make_roi_box_post_processor(cfg) -> PostProcessor:
    h = cfg.MODEL.ROI_HEADS
    return PostProcessor(h.SCORE_THRESH, h.NMS, h.DETECTIONS_PER_IMG, h.MIN_SIZE, BoxCoder(h.BBOX_REG_WEIGHTS))
