"""RPN post-processing: proposals from anchors + deltas, top-n per level, NMS per image and level.

All images go through one `detops.ops.batched_nms` call: the NMS category of a candidate is
image_index * num_levels + level, so boxes of different images or levels never suppress each
other, and there is no Python loop over images.

In training the proposals come in fixed shapes instead, without a host sync: each (image,
level) is one row of a `detops.ops.nms_padded` call, and the best post_nms_top_n kept boxes of
each image are taken across its levels. Every image then gets exactly post_nms_top_n
proposals, with a "valid" field that is False on the padding (boxes of zeros), so the RoI
heads can sample and pool them in fixed shapes too.
"""
from __future__ import annotations

from typing import List, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ...ops import batched_nms, nms_padded
from ...structures import BoxList
from ..box_coder import BoxCoder
from ..utils import host_tensor, top_k_per_group


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
            list[BoxList]: proposals of each image with an "objectness" field (probabilities);
            in training, post_nms_top_n of them per image with a "valid" field (bool).
        """
        num_images = len(anchors)
        device = objectness.device
        proposals = self.box_coder.decode(deltas.detach(), torch.cat(anchors, 0)).view(num_images, -1, 4)
        objectness = objectness.detach().reshape(num_images, -1)
        if self.training:
            return self._padded(proposals, objectness, num_anchors_per_level, image_sizes)
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

        boxes = self._clip(boxes, image_sizes)

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

    @staticmethod
    def _clip(boxes: Tensor, image_sizes) -> Tensor:
        """Clip [B, ..., 4] boxes to each image's (h, w): a list of (h, w) or a Tensor[B, 2]."""
        if isinstance(image_sizes, Tensor):
            sizes = image_sizes.to(boxes.dtype)
        else:
            sizes = host_tensor(image_sizes, boxes.dtype, boxes.device)  # [B, 2] (h, w)
        shape = (-1,) + (1,) * (boxes.dim() - 2)
        x = torch.minimum(boxes[..., 0::2].clamp(min=0), sizes[:, 1].view(shape + (1,)))
        y = torch.minimum(boxes[..., 1::2].clamp(min=0), sizes[:, 0].view(shape + (1,)))
        return torch.stack((x, y), dim=-1).reshape(boxes.shape)

    def _padded(self, proposals: Tensor, objectness: Tensor, num_anchors_per_level: List[int],
                image_sizes: List[Tuple[int, int]]) -> List[BoxList]:
        boxes, scores, valid = self.padded(proposals, objectness, num_anchors_per_level, image_sizes)
        return self.boxlists(boxes, scores, valid, image_sizes)

    @staticmethod
    def boxlists(boxes: Tensor, scores: Tensor, valid: Tensor, image_sizes: List[Tuple[int, int]]) -> List[BoxList]:
        """`padded`'s tensors as one BoxList per image ("objectness" and "valid" fields)."""
        result = []
        for (h, w), b, s, v in zip(image_sizes, boxes, scores, valid):
            bl = BoxList(b, (w, h), mode="xyxy")
            bl.add_field("objectness", s)
            bl.add_field("valid", v)
            result.append(bl)
        return result

    def padded(self, proposals: Tensor, objectness: Tensor, num_anchors_per_level: List[int],
               image_sizes) -> Tuple[Tensor, Tensor, Tensor]:
        """The training proposals, with no host sync: [B, A, 4] decoded boxes and [B, A] logits
        -> post_nms_top_n proposals per image as (boxes [B, P, 4], objectness probabilities
        [B, P], valid [B, P] bool); padding has valid False, zero boxes and objectness 0.
        image_sizes: a list of (h, w) or a Tensor[B, 2] of them."""
        num_images, num_levels = proposals.shape[0], len(num_anchors_per_level)
        ks = [min(self.pre_nms_top_n(), n) for n in num_anchors_per_level]
        width = max(ks)
        batch = torch.arange(num_images, device=proposals.device)[:, None]
        level_scores, level_boxes, offset = [], [], 0
        for ob, n, k in zip(objectness.split(num_anchors_per_level, 1), num_anchors_per_level, ks):
            top, idx = ob.topk(k, dim=1)
            level_scores.append(F.pad(top.sigmoid(), (0, width - k), value=float("-inf")))
            level_boxes.append(F.pad(proposals[batch, idx + offset], (0, 0, 0, width - k)))
            offset += n
        scores = torch.stack(level_scores, 1)  # [B, L, width]; -inf pads
        boxes = self._clip(torch.stack(level_boxes, 1), image_sizes)  # [B, L, width, 4]
        ws, hs = boxes[..., 2] - boxes[..., 0], boxes[..., 3] - boxes[..., 1]
        ok = (ws >= self.min_size) & (hs >= self.min_size) & (scores >= self.score_thresh)
        scores = torch.where(ok, scores, float("-inf"))
        per_level = min(self.post_nms_top_n(), width)
        keep, _ = nms_padded(boxes.reshape(-1, width, 4), scores.reshape(-1, width), self.nms_thresh,
                             float("-inf"), per_level)  # [B * L, per_level], -1 pads
        kept = keep.clamp(min=0)
        kept_scores = torch.where(keep >= 0, scores.reshape(-1, width).gather(1, kept), float("-inf"))
        kept_boxes = boxes.reshape(-1, width, 4).gather(1, kept[..., None].expand(-1, -1, 4))
        kept_scores = kept_scores.reshape(num_images, num_levels * per_level)
        kept_boxes = kept_boxes.reshape(num_images, num_levels * per_level, 4)
        # the best post_nms_top_n of each image across its levels, by decreasing score
        top, idx = kept_scores.topk(min(self.post_nms_top_n(), num_levels * per_level), dim=1)
        valid = top > float("-inf")
        boxes = torch.where(valid[..., None], kept_boxes.gather(1, idx[..., None].expand(-1, -1, 4)), 0.0)
        return boxes, torch.where(valid, top, 0.0), valid


def make_rpn_postprocessor(cfg, box_coder: BoxCoder) -> RPNPostProcessor:
    rpn = cfg.MODEL.RPN
    fpn = "FPN" in cfg.MODEL.BACKBONE.CONV_BODY
    post = (rpn.FPN_POST_NMS_TOP_N_TRAIN, rpn.FPN_POST_NMS_TOP_N_TEST) if fpn else \
        (rpn.POST_NMS_TOP_N_TRAIN, rpn.POST_NMS_TOP_N_TEST)
    return RPNPostProcessor((rpn.PRE_NMS_TOP_N_TRAIN, rpn.PRE_NMS_TOP_N_TEST), post, rpn.NMS_THRESH,
                            rpn.MIN_SIZE, rpn.SCORE_THRESH, box_coder)
