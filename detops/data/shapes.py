"""A synthetic detection dataset: circles, squares and triangles on textured backgrounds.

Every image is drawn on demand from its index and the dataset seed, so a split is the same on
every machine and every run without anything stored on disk. Objects are solid-coloured, may
overlap (a later shape hides part of an earlier one; the earlier mask and box are cut to what
stays visible, and an object left with less than a third of its area is dropped).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Dict, List, Tuple

import numpy as np
import torch

CLASSES = ("__background__", "circle", "square", "triangle")


@lru_cache(maxsize=8)
def _pixel_centres(size: int):
    """(yy, xx) [size, size] float32 grids of pixel centres (read-only)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) + 0.5
    yy.setflags(write=False)
    xx.setflags(write=False)
    return yy, xx


def _background(rng: np.random.Generator, size: int) -> np.ndarray:
    """A [size, size, 3] float image: a two-colour linear gradient plus smooth and fine noise."""
    c0, c1 = rng.uniform(0.15, 0.85, 3), rng.uniform(0.15, 0.85, 3)
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    t = (np.cos(angle) * xx + np.sin(angle) * yy)
    t = (t - t.min()) / max(t.max() - t.min(), 1e-6)
    img = c0[None, None] * (1 - t[..., None]) + c1[None, None] * t[..., None]
    coarse = rng.normal(0, 1, (size // 16 + 2, size // 16 + 2, 1))
    coarse = np.kron(coarse, np.ones((16, 16, 1)))[:size, :size]
    img = img + 0.05 * coarse + rng.normal(0, 0.04, (size, size, 3))
    return img.astype(np.float32)


def _shape_mask(kind: int, cx: float, cy: float, s: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Boolean [size, size] mask of one shape of side (or diameter) s centred at (cx, cy)."""
    yy, xx = _pixel_centres(size)
    r = s / 2
    if kind == 1:  # circle
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r * r
    if kind == 2:  # square (axis-aligned)
        return (np.abs(xx - cx) <= r) & (np.abs(yy - cy) <= r)
    # triangle: roughly equilateral, pointing up or down, inside the s x s square
    up = rng.random() < 0.5
    top, bottom = (cy - r, cy + r) if up else (cy + r, cy - r)
    pts = np.array([[cx, top], [cx - r, bottom], [cx + r, bottom]], dtype=np.float32)
    inside = np.ones((size, size), dtype=bool)
    for i in range(3):
        (x0, y0), (x1, y1) = pts[i], pts[(i + 1) % 3]
        cross = (x1 - x0) * (yy - y0) - (y1 - y0) * (xx - x0)
        ref = (x1 - x0) * (pts[(i + 2) % 3][1] - y0) - (y1 - y0) * (pts[(i + 2) % 3][0] - x0)
        inside &= (cross * np.sign(ref)) >= 0
    return inside


def _mask_box(mask: np.ndarray) -> List[float]:
    ys, xs = np.nonzero(mask)
    return [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]


def make_shapes_image(seed: int, index: int, size: int = 160, min_objects: int = 1, max_objects: int = 4,
                      min_obj_size: int = 15, max_obj_size: int = 60) -> Tuple[np.ndarray, Dict[str, np.ndarray]]:
    """Image `index` of the shapes dataset with seed `seed`.

    Returns (image [size, size, 3] float32 in [0, 1], annotations) with "boxes" [N, 4] float32
    (x1, y1, x2, y2, tight around the visible mask), "labels" [N] int64 (1 circle, 2 square,
    3 triangle) and "masks" [N, size, size] uint8 (N >= 1).
    """
    rng = np.random.default_rng([seed, index])
    img = _background(rng, size)
    n = int(rng.integers(min_objects, max_objects + 1))
    masks: List[np.ndarray] = []
    labels: List[int] = []
    areas: List[int] = []
    for _ in range(n):
        kind = int(rng.integers(1, 4))
        s = float(rng.uniform(min_obj_size, max_obj_size))
        cx, cy = rng.uniform(s / 2, size - s / 2, 2)
        m = _shape_mask(kind, cx, cy, s, size, rng)
        if m.sum() < 16:
            continue
        # a solid colour that stands out from the local background
        for _try in range(10):
            colour = rng.uniform(0, 1, 3)
            if np.abs(colour - img[m].mean(axis=0)).sum() > 0.6:
                break
        img[m] = colour + rng.normal(0, 0.02, (int(m.sum()), 3))
        masks = [old & ~m for old in masks]
        masks.append(m)
        labels.append(kind)
        areas.append(int(m.sum()))
    keep = [i for i, m in enumerate(masks) if m.sum() >= max(16, areas[i] / 3)]
    if not keep:  # every object hidden (cannot happen with n=1); fall back to one square
        m = _shape_mask(2, size / 2, size / 2, (min_obj_size + max_obj_size) / 2, size, rng)
        img[m] = 1.0 - img[m].mean(axis=0)
        masks, labels, keep = [m], [2], [0]
    out_masks = np.stack([masks[i] for i in keep]).astype(np.uint8)
    boxes = np.array([_mask_box(masks[i]) for i in keep], dtype=np.float32)
    return np.clip(img, 0, 1), {"boxes": boxes, "labels": np.array([labels[i] for i in keep], dtype=np.int64),
                                "masks": out_masks}


class ShapesDataset(torch.utils.data.Dataset):
    """`num_images` synthetic images; the split is chosen by the seed (train and val use
    different seeds, so they never share an image).

    __getitem__(index or (index, aug_seed)) -> (image [3, H, W] float in [0, 1], target dict
    with "boxes", "labels", "masks" [N, H, W] uint8, "image_id"), after `transforms`.
    """

    CLASSES = CLASSES

    def __init__(self, num_images: int, seed: int, image_size: int = 160, min_objects: int = 1, max_objects: int = 4,
                 min_obj_size: int = 15, max_obj_size: int = 60, transforms=None, name: str = "shapes"):
        if num_images < 1:
            raise ValueError(f"ShapesDataset: num_images must be >= 1, got {num_images}")
        if not (0 < min_obj_size <= max_obj_size < image_size):
            raise ValueError(f"ShapesDataset: need 0 < MIN_OBJ_SIZE <= MAX_OBJ_SIZE < IMAGE_SIZE, got "
                             f"{min_obj_size}, {max_obj_size}, {image_size}")
        self.num_images = num_images
        self.seed = seed
        self.kwargs = dict(size=image_size, min_objects=min_objects, max_objects=max_objects,
                           min_obj_size=min_obj_size, max_obj_size=max_obj_size)
        self.transforms = transforms
        self.name = name
        # contiguous label id -> dataset category id (the identity here)
        self.contiguous_to_category = {i: i for i in range(1, len(CLASSES))}
        self._coco = None

    def __len__(self) -> int:
        return self.num_images

    def raw(self, index: int):
        return make_shapes_image(self.seed, index, **self.kwargs)

    def __getitem__(self, item):
        index, aug_seed = item if isinstance(item, tuple) else (item, None)
        img, ann = self.raw(index)
        image = torch.from_numpy(img).permute(2, 0, 1).contiguous()
        target = {"boxes": torch.from_numpy(ann["boxes"]), "labels": torch.from_numpy(ann["labels"]),
                  "masks": torch.from_numpy(ann["masks"]), "image_id": index}
        if self.transforms is not None:
            image, target = self.transforms(image, target, aug_seed)
        return image, target

    def image_info(self, index: int) -> Dict[str, int]:
        s = self.kwargs["size"]
        return {"id": index, "height": s, "width": s}

    @property
    def coco(self):
        """The split's ground truth as an in-memory pycocotools COCO object (built once)."""
        if self._coco is None:
            from .coco_utils import coco_from_annotations
            images, anns = [], []
            for i in range(self.num_images):
                _, ann = self.raw(i)
                images.append(self.image_info(i))
                anns.append(ann)
            cats = [{"id": i, "name": n} for i, n in enumerate(CLASSES) if i > 0]
            self._coco = coco_from_annotations(images, anns, cats)
        return self._coco
