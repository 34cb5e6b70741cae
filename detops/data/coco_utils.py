"""Helpers between detops targets / detections and pycocotools' COCO format."""
from __future__ import annotations

import contextlib
import io
from typing import Dict, List, Sequence

import numpy as np


def encode_masks(masks: np.ndarray) -> List[dict]:
    """RLE of each [N, H, W] binary mask, with the counts as str (JSON-serialisable)."""
    from pycocotools import mask as mask_util
    masks = np.asarray(masks).astype(np.uint8)
    if masks.shape[0] == 0:
        return []
    # pycocotools wants [H, W, N] in Fortran order
    rles = mask_util.encode(np.asfortranarray(masks.transpose(1, 2, 0)))
    for r in rles:
        r["counts"] = r["counts"].decode("ascii")
    return rles


def coco_from_annotations(images: Sequence[dict], annotations: Sequence[Dict[str, np.ndarray]], categories: Sequence[dict]):
    """A pycocotools COCO object built in memory.

    images: [{"id", "height", "width"}]; annotations: per image {"boxes" [N, 4] xyxy, "labels" [N]
    (category ids), "masks" [N, H, W] (optional)}; categories: [{"id", "name"}].
    """
    from pycocotools import mask as mask_util
    from pycocotools.coco import COCO
    anns = []
    for info, ann in zip(images, annotations):
        rles = encode_masks(ann["masks"]) if "masks" in ann else [None] * len(ann["boxes"])
        for box, label, rle in zip(ann["boxes"], ann["labels"], rles):
            x1, y1, x2, y2 = [float(v) for v in box]
            a = {"id": len(anns) + 1, "image_id": int(info["id"]), "category_id": int(label),
                 "bbox": [x1, y1, x2 - x1, y2 - y1], "iscrowd": 0}
            if rle is not None:
                a["segmentation"] = rle
                a["area"] = float(mask_util.area({"size": rle["size"], "counts": rle["counts"].encode("ascii")}))
            else:
                a["area"] = (x2 - x1) * (y2 - y1)
            anns.append(a)
    coco = COCO()
    coco.dataset = {"images": [dict(i) for i in images], "annotations": anns, "categories": [dict(c) for c in categories]}
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco
