"""RPN post-processing: proposals from anchors + deltas, top-n per level, NMS per image and level.

All images go through one `detops.ops.batched_nms` call: the NMS category of a candidate is
image_index * num_levels + level, so boxes of different images or levels never suppress each
other, and there is no Python loop over images.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor, nn

from ...ops import batched_nms
from ...structures import BoxList
from ..box_coder import BoxCoder
from ..utils import top_k_per_group


class RPNPostProcessor(nn.Module):
    """Args:
    pre_nms_top_n (train, test): candidates kept per level and image before NMS.
    post_nms_top_n (train, test): proposals kept per image after NMS.
    nms_thresh (float): IoU threshold of the NMS.
    min_size (float): proposals narrower or shorter than this are removed.
    score_thresh (float): proposals whose objectness probability is below this are removed.
    box_coder (BoxCoder): decodes deltas.
    """

    def __init__(self, pre_nms_top_n: Tuple[int, int], post_nms_top_n: Tuple[int, int], nms_thresh: float,
                 min_size: float, score_thresh: float, box_coder: BoxCoder):
        super().__init__()
        self._pre = pre_nms_top_n
        self._post = post_nms_top_n
        self.nms_thresh = nms_thresh
        self.min_size = min_size
        self.score_thresh = score_thresh
        self.box_coder = box_coder

    def pre_nms_top_n(self) -> int:
        return self._pre[0] if self.training else self._pre[1]

    def post_nms_top_n(self) -> int:
        return self._post[0] if self.training else self._post[1]

    def forward(self, anchors: List[Tensor], objectness: Tensor, deltas: Tensor,
                num_anchors_per_level: List[int], image_sizes: List[Tuple[int, int]]) -> List[BoxList]:
        """
        Args:
            anchors (list[Tensor[A_total, 4]]): anchors of each image.
            objectness (Tensor[B * A_total, 1]), deltas (Tensor[B * A_total, 4]): flattened head outputs.
            num_anchors_per_level (list[int]): A_l, with sum A_l = A_total.
            image_sizes (list[(h, w)]): size of each image before padding.
        Returns:
            list[BoxList]: proposals of each image with an "objectness" field (probabilities).
        """
        num_images = len(anchors)
        device = objectness.device
        proposals = self.box_coder.decode(deltas.detach(), torch.cat(anchors, 0)).view(num_images, -1, 4)
        objectness = objectness.detach().reshape(num_images, -1)
        num_levels = len(num_anchors_per_level)

        # top-n per level and image
        top_idx, level_ids, offset = [], [], 0
        for lvl, (ob, n) in enumerate(zip(objectness.split(num_anchors_per_level, 1), num_anchors_per_level)):
            k = min(self.pre_nms_top_n(), n)
            _, idx = ob.topk(k, dim=1)
            top_idx.append(idx + offset)
            level_ids.append(torch.full((k,), lvl, dtype=torch.int64, device=device))
            offset += n
        top_idx = torch.cat(top_idx, dim=1)
        batch = torch.arange(num_images, device=device)[:, None]
        scores = objectness[batch, top_idx].sigmoid()
        boxes = proposals[batch, top_idx]
        k = top_idx.shape[1]

        # clip to each image
        sizes = torch.tensor(image_sizes, dtype=boxes.dtype, device=device)  # [B, 2] (h, w)
        x = torch.minimum(boxes[..., 0::2].clamp(min=0), sizes[:, 1].view(-1, 1, 1))
        y = torch.minimum(boxes[..., 1::2].clamp(min=0), sizes[:, 0].view(-1, 1, 1))
        boxes = torch.stack((x, y), dim=-1).reshape(num_images, k, 4)

        boxes = boxes.reshape(-1, 4)
        scores = scores.reshape(-1)
        image_ids = batch.expand(num_images, k).reshape(-1)
        groups = image_ids * num_levels + torch.cat(level_ids).repeat(num_images)
        ws, hs = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
        valid = torch.where((ws >= self.min_size) & (hs >= self.min_size) & (scores >= self.score_thresh))[0]
        keep = batched_nms(boxes[valid], scores[valid], groups[valid], self.nms_thresh)
        keep = valid[keep]
        keep, counts = top_k_per_group(image_ids, keep, self.post_nms_top_n(), num_images)

        result = []
        for (h, w), b, s in zip(image_sizes, boxes[keep].split(counts), scores[keep].split(counts)):
            bl = BoxList(b, (w, h), mode="xyxy")
            bl.add_field("objectness", s)
            result.append(bl)
        return result


def make_rpn_postprocessor(cfg, box_coder: BoxCoder) -> RPNPostProcessor:
    rpn = cfg.MODEL.RPN
    fpn = "FPN" in cfg.MODEL.BACKBONE.CONV_BODY
    post = (rpn.FPN_POST_NMS_TOP_N_TRAIN, rpn.FPN_POST_NMS_TOP_N_TEST) if fpn else \
        (rpn.POST_NMS_TOP_N_TRAIN, rpn.POST_NMS_TOP_N_TEST)
    return RPNPostProcessor((rpn.PRE_NMS_TOP_N_TRAIN, rpn.PRE_NMS_TOP_N_TEST), post, rpn.NMS_THRESH,
                            rpn.MIN_SIZE, rpn.SCORE_THRESH, box_coder)
