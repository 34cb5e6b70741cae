"""Input side of the detector: validate targets, normalise and resize images, pad them into an
ImageList; output side: scale detections back to the original images and paste the masks."""
from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from ..structures import BoxList, ImageList, to_image_list
from .roi_heads.mask_head.inference import paste_masks_in_image


def _resize_boxes(boxes: Tensor, original: Tuple[int, int], new: Tuple[int, int]) -> Tensor:
    """Scale xyxy boxes from an image of size original (h, w) to new (h, w)."""
    # float32 ratios, computed on the host (no host-to-device copy, no sync)
    rh = (torch.tensor(float(new[0])) / torch.tensor(float(original[0]))).item()
    rw = (torch.tensor(float(new[1])) / torch.tensor(float(original[1]))).item()
    x1, y1, x2, y2 = boxes.unbind(1)
    return torch.stack((x1 * rw, y1 * rh, x2 * rw, y2 * rh), dim=1)


def _target_boxes(t: Any) -> Optional[Tensor]:
    boxes = t.bbox if isinstance(t, BoxList) else t.get("boxes") if isinstance(t, dict) else None
    return boxes if isinstance(boxes, Tensor) else None


def _degenerate(boxes: Tensor) -> Tensor:
    return (boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])


def check_targets(targets: List[Any]) -> None:
    """Reject malformed targets with a message naming the image and the box. The degenerate-box
    test of the whole batch costs one host read (not one per image)."""
    xyxy = []
    for i, t in enumerate(targets):
        boxes = _target_boxes(t)
        if boxes is None:
            raise ValueError(f"GeneralizedRCNN: target {i} must be a dict with a 'boxes' tensor (or a BoxList)")
        if boxes.dim() != 2 or boxes.shape[-1] != 4:
            if boxes.numel() == 0:
                continue
            raise ValueError(f"GeneralizedRCNN: target {i}: boxes must be a [N, 4] tensor, got {list(boxes.shape)}")
        labels = t.get_field("labels") if isinstance(t, BoxList) and t.has_field("labels") else \
            None if isinstance(t, BoxList) else t.get("labels")
        if labels is None or labels.shape[0] != boxes.shape[0]:
            raise ValueError(f"GeneralizedRCNN: target {i} needs one label per box ('labels' of shape [{boxes.shape[0]}])")
        if boxes.numel() > 0 and not (isinstance(t, BoxList) and t.mode != "xyxy"):
            xyxy.append((i, boxes))
    if not xyxy or not bool(torch.stack([_degenerate(b).any() for _, b in xyxy]).any()):
        return
    for i, boxes in xyxy:
        bad = torch.where(_degenerate(boxes))[0]
        if bad.numel() > 0:
            j = int(bad[0])
            raise ValueError(
                f"GeneralizedRCNN: target {i} (image {i} of the batch) has a degenerate box at index {j}: "
                f"{boxes[j].tolist()}; boxes must be x1, y1, x2, y2 with x2 > x1 and y2 > y1 "
                f"({bad.numel()} such box(es) in this image)"
            )


class GeneralizedRCNNTransform(nn.Module):
    """Normalise, resize so that the short side is min_size (long side at most max_size), pad.

    Args:
        min_size (tuple[int]): candidate short sides in training (a random one per image).
        max_size (int): bound on the long side in training.
        min_size_test, max_size_test (int): the same in eval (default: min_size[-1], max_size).
        image_mean, image_std (list[float]): normalisation, applied to [0, 1] RGB images (or to
            BGR 0..255 ones with to_bgr255).
        size_divisible (int): the padded batch is a multiple of this.
    """

    def __init__(self, min_size: Sequence[int], max_size: int, image_mean: Sequence[float], image_std: Sequence[float],
                 size_divisible: int = 32, to_bgr255: bool = False, min_size_test: Optional[int] = None,
                 max_size_test: Optional[int] = None):
        super().__init__()
        self.min_size = tuple(min_size) if isinstance(min_size, (list, tuple)) else (min_size,)
        self.max_size = max_size
        self.min_size_test = self.min_size[-1] if min_size_test is None else min_size_test
        self.max_size_test = max_size if max_size_test is None else max_size_test
        self.image_mean = list(image_mean)
        self.image_std = list(image_std)
        self.size_divisible = size_divisible
        self.to_bgr255 = to_bgr255
        self._mean_std = {}

    def normalize(self, image: Tensor) -> Tensor:
        if not image.is_floating_point():
            raise TypeError(f"GeneralizedRCNN: images must be float tensors in [0, 1], got {image.dtype}")
        if self.to_bgr255:
            image = image[[2, 1, 0]] * 255
        key = (image.dtype, image.device)
        if key not in self._mean_std:  # one host-to-device copy per dtype and device
            self._mean_std[key] = (
                torch.as_tensor(self.image_mean, dtype=image.dtype, device=image.device)[:, None, None],
                torch.as_tensor(self.image_std, dtype=image.dtype, device=image.device)[:, None, None],
            )
        mean, std = self._mean_std[key]
        return (image - mean) / std

    def resize(self, image: Tensor, target: Optional[Dict[str, Tensor]]):
        h, w = image.shape[-2:]
        if self.training:
            size, max_size = random.choice(self.min_size), self.max_size
        else:
            size, max_size = self.min_size_test, self.max_size_test
        scale = min(float(size) / min(h, w), float(max_size) / max(h, w))
        # the size F.interpolate would produce; an image of that size already is returned as it
        # is (resampling to the same size copies every pixel unchanged)
        same = int(h * scale) == h and int(w * scale) == w
        if not same:
            image = F.interpolate(image[None], scale_factor=scale, mode="bilinear", recompute_scale_factor=True,
                                  align_corners=False)[0]
        if target is None:
            return image, None
        target = dict(target)
        target["boxes"] = _resize_boxes(target["boxes"], (h, w), tuple(image.shape[-2:]))
        if "masks" in target and not same:
            m = target["masks"]
            target["masks"] = F.interpolate(m[:, None].float(), scale_factor=scale, recompute_scale_factor=True)[:, 0].byte()
        return image, target

    def forward(self, images: List[Tensor], targets: Optional[List[Any]] = None) -> Tuple[ImageList, Optional[List[BoxList]]]:
        for i, img in enumerate(images):
            if not isinstance(img, Tensor) or img.dim() != 3:
                shape = list(img.shape) if isinstance(img, Tensor) else type(img).__name__
                raise ValueError(f"GeneralizedRCNN: image {i} must be a [C, H, W] tensor, got {shape}")
        if targets is not None:
            targets = [_as_dict(t) for t in targets]
        out_images, out_targets = [], []
        for i, img in enumerate(images):
            t = targets[i] if targets is not None else None
            img, t = self.resize(self.normalize(img), t)
            out_images.append(img)
            out_targets.append(t)
        image_list = to_image_list(out_images, self.size_divisible)
        if targets is None:
            return image_list, None
        boxlists = []
        for (h, w), t in zip(image_list.image_sizes, out_targets):
            bl = BoxList(t["boxes"].reshape(-1, 4), (w, h), mode="xyxy")
            for k, v in t.items():
                if k != "boxes":
                    bl.add_field(k, v)
            boxlists.append(bl)
        return image_list, boxlists

    def postprocess(self, detections: List[BoxList], image_sizes: List[Tuple[int, int]],
                    original_sizes: List[Tuple[int, int]], mask_threshold: float = -1.0) -> List[Dict[str, Tensor]]:
        results = []
        for det, size, orig in zip(detections, image_sizes, original_sizes):
            boxes = _resize_boxes(det.bbox, size, orig)
            out = {"boxes": boxes, "labels": det.get_field("labels"), "scores": det.get_field("scores")}
            if det.has_field("mask"):
                masks = paste_masks_in_image(det.get_field("mask"), boxes, orig)
                out["masks"] = masks > mask_threshold if mask_threshold > 0 else masks
            results.append(out)
        return results


def _as_dict(target: Any) -> Dict[str, Tensor]:
    if isinstance(target, BoxList):
        d = {"boxes": target.convert("xyxy").bbox}
        for k in target.fields():
            d[k] = target.get_field(k)
        return d
    return dict(target)


def build_transform(cfg) -> GeneralizedRCNNTransform:
    i = cfg.INPUT
    return GeneralizedRCNNTransform(
        min_size=i.MIN_SIZE_TRAIN, max_size=i.MAX_SIZE_TRAIN, image_mean=i.PIXEL_MEAN, image_std=i.PIXEL_STD,
        size_divisible=cfg.DATALOADER.SIZE_DIVISIBILITY, to_bgr255=i.TO_BGR255,
        min_size_test=i.MIN_SIZE_TEST, max_size_test=i.MAX_SIZE_TEST,
    )
