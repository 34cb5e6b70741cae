"""A COCO-format dataset: an image folder and an instances annotation JSON, read with pycocotools.

Labels are made contiguous (1..K in the order of the sorted category ids; 0 is background) and
mapped back to the JSON's category ids for evaluation. Bad samples never stop a run: an
annotation with a degenerate box or a category missing from the JSON's "categories" is skipped
with a warning, and so is an image that cannot be read.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
from typing import Dict, List

import numpy as np
import torch

logger = logging.getLogger("detops.data")


class COCODataset(torch.utils.data.Dataset):
    """__getitem__(index or (index, aug_seed)) -> (image [3, H, W] float in [0, 1], target) or
    None when the image cannot be read (the loader's collate drops it)."""

    def __init__(self, img_dir: str, ann_file: str, transforms=None, remove_images_without_annotations: bool = False,
                 name: str = "coco"):
        from pycocotools.coco import COCO
        with contextlib.redirect_stdout(io.StringIO()):
            self.coco = COCO(ann_file)
        self.img_dir = img_dir
        self.transforms = transforms
        self.name = name
        cat_ids = sorted(self.coco.getCatIds())
        self.category_to_contiguous = {c: i + 1 for i, c in enumerate(cat_ids)}
        self.contiguous_to_category = {v: k for k, v in self.category_to_contiguous.items()}
        self.CLASSES = ("__background__",) + tuple(self.coco.cats[c]["name"] for c in cat_ids)
        ids = sorted(self.coco.imgs.keys())
        self._anns: Dict[int, List[dict]] = {i: self._valid_annotations(i) for i in ids}
        if remove_images_without_annotations:
            dropped = [i for i in ids if not self._anns[i]]
            if dropped:
                logger.info("%s: %d image(s) without usable annotations left out of training", name, len(dropped))
            ids = [i for i in ids if self._anns[i]]
        self.ids = ids

    def _valid_annotations(self, img_id: int) -> List[dict]:
        info = self.coco.imgs[img_id]
        out = []
        for a in self.coco.imgToAnns.get(img_id, []):
            if a.get("iscrowd", 0):
                continue
            cat = a.get("category_id")
            if cat not in self.category_to_contiguous:
                logger.warning("%s: skipping annotation %s of image %s (%s): unknown category_id %r (not in the "
                               "JSON's categories)", self.name, a.get("id"), img_id, info.get("file_name"), cat)
                continue
            bbox = a.get("bbox")
            if bbox is None or len(bbox) != 4 or not (bbox[2] >= 1 and bbox[3] >= 1):
                logger.warning("%s: skipping annotation %s of image %s (%s): degenerate box %r (width and height "
                               "must be >= 1)", self.name, a.get("id"), img_id, info.get("file_name"), bbox)
                continue
            out.append(a)
        return out

    def __len__(self) -> int:
        return len(self.ids)

    def image_info(self, index: int) -> dict:
        return self.coco.imgs[self.ids[index]]

    def __getitem__(self, item):
        from PIL import Image
        index, aug_seed = item if isinstance(item, tuple) else (item, None)
        img_id = self.ids[index]
        info = self.coco.imgs[img_id]
        path = os.path.join(self.img_dir, info["file_name"])
        try:
            with Image.open(path) as im:
                im = im.convert("RGB")
                arr = np.asarray(im, dtype=np.uint8).copy()
        except Exception as e:  # unreadable or corrupt file
            logger.warning("%s: skipping image %s (%s): cannot read it: %s", self.name, img_id, path, e)
            return None
        h, w = arr.shape[:2]
        image = torch.from_numpy(arr).permute(2, 0, 1).float().div_(255)
        anns = self._anns[img_id]
        boxes = torch.tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        labels = torch.tensor([self.category_to_contiguous[a["category_id"]] for a in anns], dtype=torch.int64)
        target = {"boxes": boxes, "labels": labels, "image_id": img_id}
        if anns and all("segmentation" in a for a in anns):
            target["masks"] = torch.from_numpy(np.stack([self.coco.annToMask(a) for a in anns]))
        else:
            target["masks"] = torch.zeros((0, h, w), dtype=torch.uint8)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        target = {k: (v[keep] if isinstance(v, torch.Tensor) and len(v) == len(keep) else v) for k, v in target.items()}
        if self.transforms is not None:
            image, target = self.transforms(image, target, aug_seed)
        return image, target
