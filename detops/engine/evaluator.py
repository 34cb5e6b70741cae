"""COCO evaluation (bbox and segm AP / AP50 / AP75 with pycocotools) of a detector on a dataset.

Each process runs the model on its share of the images; the detections are gathered to the main
process, mapped from contiguous labels back to the dataset's category ids, written to
OUTPUT_DIR/inference/<dataset>/detections_{bbox,segm}.json and scored against the dataset's
ground truth (a pycocotools COCO object; the shapes dataset builds one in memory).
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import time
from typing import Dict, List

import numpy as np
import torch

from ..data.coco_utils import encode_masks
from .comm import all_gather, is_main_process, synchronize

logger = logging.getLogger("detops.engine")

METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")


@torch.no_grad()
def run_inference(model, data_loader, device) -> Dict[int, dict]:
    """{image_id: {"boxes", "labels", "scores", "masks" (bool [K, H, W])}} for this process's images."""
    model.eval()
    out = {}
    for images, targets in data_loader:
        if not images:
            continue
        preds = model([img.to(device) for img in images])
        for t, p in zip(targets, preds):
            r = {k: v.cpu() for k, v in p.items() if k != "masks"}
            if "masks" in p:
                r["masks"] = (p["masks"][:, 0] > 0.5).cpu()
            out[int(t["image_id"])] = r
    return out


def to_coco_results(predictions: Dict[int, dict], contiguous_to_category: Dict[int, int]):
    """(bbox results, segm results) in COCO's results format."""
    bbox, segm = [], []
    for img_id, p in predictions.items():
        if len(p["boxes"]) == 0:
            continue
        boxes = p["boxes"].float().numpy()
        xywh = np.concatenate([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], axis=1)
        cats = [contiguous_to_category[int(l)] for l in p["labels"]]
        scores = p["scores"].float().tolist()
        for b, c, s in zip(xywh.tolist(), cats, scores):
            bbox.append({"image_id": img_id, "category_id": c, "bbox": [round(v, 3) for v in b], "score": s})
        if "masks" in p:
            for rle, c, s in zip(encode_masks(p["masks"].numpy()), cats, scores):
                segm.append({"image_id": img_id, "category_id": c, "segmentation": rle, "score": s})
    return bbox, segm


def coco_evaluate(coco_gt, results: List[dict], iou_type: str, img_ids) -> Dict[str, float]:
    """AP, AP50, AP75, APs, APm, APl of `results` (-1 where pycocotools has no value)."""
    from pycocotools.cocoeval import COCOeval
    if not results:
        return {m: 0.0 for m in METRICS}
    with contextlib.redirect_stdout(io.StringIO()):
        res = coco_gt.loadRes(results)
        ev = COCOeval(coco_gt, res, iou_type)
        ev.params.imgIds = sorted(img_ids)
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return {m: float(v) for m, v in zip(METRICS, ev.stats[:6])}


def format_table(name: str, results: Dict[str, Dict[str, float]]) -> str:
    lines = [f"COCO evaluation on {name}:", f"{'task':<6}" + "".join(f"{m:>8}" for m in METRICS)]
    for task, r in results.items():
        lines.append(f"{task:<6}" + "".join(f"{r[m]:8.4f}" for m in METRICS))
    for task, r in results.items():
        lines.append(f"{task} AP: {r['AP']:.4f}   {task} AP50: {r['AP50']:.4f}   {task} AP75: {r['AP75']:.4f}")
    return "\n".join(lines)


def evaluate(model, dataset, data_loader, device, output_dir: str = "", name: str = "") -> Dict[str, Dict[str, float]]:
    """COCO metrics of `model` on `dataset` (every process calls it; the main process returns
    {"bbox": {...}, "segm": {...}} and the others {})."""
    name = name or getattr(dataset, "name", "dataset")
    t0 = time.time()
    local = run_inference(model, data_loader, torch.device(device))
    gathered = all_gather(local)
    synchronize()
    if not is_main_process():
        return {}
    preds: Dict[int, dict] = {}
    for part in gathered:
        preds.update(part)
    logger.info("%s: inference on %d images in %.1fs", name, len(preds), time.time() - t0)
    bbox, segm = to_coco_results(preds, dataset.contiguous_to_category)
    out_dir = os.path.join(output_dir, "inference", name) if output_dir else ""
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "detections_bbox.json"), "w") as f:
            json.dump(bbox, f)
        if segm:
            with open(os.path.join(out_dir, "detections_segm.json"), "w") as f:
                json.dump(segm, f)
    results = {"bbox": coco_evaluate(dataset.coco, bbox, "bbox", preds.keys())}
    if any("masks" in p for p in preds.values()):
        results["segm"] = coco_evaluate(dataset.coco, segm, "segm", preds.keys())
    if out_dir:
        with open(os.path.join(out_dir, "metrics.json"), "w") as f:
            json.dump(results, f, indent=2)
    return results
