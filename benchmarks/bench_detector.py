"""Mask R-CNN R-50-FPN: detops' GeneralizedRCNN vs torchvision's maskrcnn_resnet50_fpn.

    python -m benchmarks.bench_detector            # CUDA: inference and training, batch 2 and 8
    python -m benchmarks.bench_detector --quick    # small images, batch 1 and 2 (a CPU smoke run)

Both models live in one process and have the same weights: torchvision's model is built with
weights=None, weights_backbone=None under a fixed seed, its ResNet body is set up the way
torchvision sets up a pretrained one (FrozenBatchNorm2d, conv1 and layer1 frozen: three trainable
stages), its heads are nudged so that they produce confident, varied detections (a random model
detects nothing, which would leave the box post-processing and the mask head idle), and detops'
model is converted from it with `from_torchvision`, so it shares torchvision's input size, RPN
pre/post-NMS top-n (train and test) and detections per image.

Inputs are random 800x1216 RGB images (both models' transforms keep that size: short side 800,
long side under 1333, already a multiple of 32); training adds four boxes per image with their
labels and box-shaped masks. Before timing, the detections of both models on one batch are
compared (same count, labels, boxes to 1e-3, scores to 1e-4, mask IoU), and the result printed.

A training iteration is forward, loss sum, backward and an SGD step (learning rate 0, so the
weights, and with them the work of every iteration, stay the same for both models). An
inference iteration is a no-grad forward, mask pasting included. Each case also has a row for
detops with MODEL.MEMORY_FORMAT "channels_last" (its detections can differ from torchvision's
by TF32 rounding, see detops/config/defaults.py). Each row is the median of
several iterations after a warm-up, timed with CUDA events (perf_counter on CPU); an
out-of-memory error is reported on its row and the next row runs.
"""
from __future__ import annotations

import argparse
import gc
from typing import Dict, List, Optional, Tuple

import torch
import torchvision
from torch import Tensor, nn

from benchmarks.timing import HEADER, Row, format_row, median_ms
from detops.testing import nudge_detector

HEIGHT, WIDTH = 800, 1216
QUICK_HEIGHT, QUICK_WIDTH = 224, 320
BOXES_PER_IMAGE = 4


# --- models ---------------------------------------------------------------------------------


def _freeze_like_pretrained(model: nn.Module) -> None:
    """What torchvision does to a body with pretrained weights: FrozenBatchNorm2d everywhere
    and only layer2..layer4 trainable (detops' MODEL.BACKBONE.FREEZE_CONV_BODY_AT: 2)."""
    body = model.backbone.body

    def swap(module: nn.Module) -> None:
        for name, child in module.named_children():
            if isinstance(child, nn.BatchNorm2d):
                frozen = torchvision.ops.FrozenBatchNorm2d(child.num_features, eps=child.eps)
                for buf in ("weight", "bias", "running_mean", "running_var"):
                    getattr(frozen, buf).copy_(getattr(child, buf).detach())
                setattr(module, name, frozen)
            else:
                swap(child)

    swap(body)
    for name, p in body.named_parameters():
        p.requires_grad_(name.startswith(("layer2", "layer3", "layer4")))


def build_models(device: str, height: int, width: int, seed: int = 0) -> Tuple[nn.Module, nn.Module]:
    """(torchvision model, detops model) with the same weights and settings, on `device`.
    The transforms' min/max size are chosen so that a height x width image is not resized."""
    from detops.modeling import from_torchvision

    torch.manual_seed(seed)
    short, long = min(height, width), max(height, width)
    tv = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, min_size=short, max_size=max(1333, long)
    )
    _freeze_like_pretrained(tv)
    nudge_detector(tv)
    tv = tv.to(device)
    dt = from_torchvision(tv)
    return tv, dt


# --- inputs ---------------------------------------------------------------------------------


def make_images(batch: int, height: int, width: int, device: str, seed: int = 2) -> List[Tensor]:
    """Random RGB images in [0, 1] with a darker and a brighter rectangle each, so that the
    features vary over the image."""
    g = torch.Generator().manual_seed(seed)
    images = []
    for i in range(batch):
        im = torch.rand(3, height, width, generator=g)
        y0, x0 = (i * 37) % (height // 2), (i * 53) % (width // 2)
        im[:, y0:y0 + height // 3, x0:x0 + width // 3] *= 0.3
        im[:, height // 2:, width // 2:] = (im[:, height // 2:, width // 2:] + 0.5).clamp(max=1)
        images.append(im.to(device))
    return images


def make_targets(batch: int, height: int, width: int, device: str, seed: int = 3,
                 boxes_per_image: int = BOXES_PER_IMAGE) -> List[Dict[str, Tensor]]:
    """boxes_per_image random boxes per image (sides 1/8 to 1/2 of the image), labels in
    1..90 and uint8 masks filling an ellipse inside each box."""
    g = torch.Generator().manual_seed(seed)
    ys = torch.arange(height, dtype=torch.float32)[:, None]
    xs = torch.arange(width, dtype=torch.float32)[None, :]
    targets = []
    for _ in range(batch):
        wh = torch.rand(boxes_per_image, 2, generator=g) * 0.375 + 0.125
        w, h = wh[:, 0] * width, wh[:, 1] * height
        x1 = torch.rand(boxes_per_image, generator=g) * (width - w)
        y1 = torch.rand(boxes_per_image, generator=g) * (height - h)
        boxes = torch.stack([x1, y1, x1 + w, y1 + h], dim=1)
        labels = torch.randint(1, 91, (boxes_per_image,), generator=g)
        masks = torch.zeros(boxes_per_image, height, width, dtype=torch.uint8)
        for j, (bx1, by1, bx2, by2) in enumerate(boxes.tolist()):
            cx, cy, rx, ry = (bx1 + bx2) / 2, (by1 + by2) / 2, (bx2 - bx1) / 2, (by2 - by1) / 2
            masks[j] = (((xs - cx) / rx) ** 2 + ((ys - cy) / ry) ** 2 <= 1).to(torch.uint8)
        targets.append({"boxes": boxes.to(device), "labels": labels.to(device), "masks": masks.to(device)})
    return targets


# --- parity ---------------------------------------------------------------------------------


def _canonical(out: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """Detections sorted by score, ties by box (the order of equal scores is arbitrary)."""
    key = [(-s, *b) for s, b in zip(out["scores"].tolist(), out["boxes"].tolist())]
    order = sorted(range(len(key)), key=lambda i: key[i])
    idx = torch.tensor(order, dtype=torch.int64, device=out["scores"].device)
    return {k: v[idx] for k, v in out.items()}


def compare_detections(expected: List[Dict[str, Tensor]], got: List[Dict[str, Tensor]]) -> Tuple[bool, str]:
    """(same, description): counts, labels, boxes (1e-3), scores (1e-4) and mask IoU at 0.5."""
    total, ious = 0, []
    for i, (a, b) in enumerate(zip(expected, got)):
        if len(a["boxes"]) != len(b["boxes"]):
            return False, f"image {i}: {len(a['boxes'])} detections (torchvision) vs {len(b['boxes'])} (detops)"
        a, b = _canonical(a), _canonical(b)
        total += len(a["boxes"])
        if not torch.equal(a["labels"], b["labels"]):
            return False, f"image {i}: labels differ"
        box_err = (a["boxes"] - b["boxes"]).abs().max().item() if len(a["boxes"]) else 0.0
        score_err = (a["scores"] - b["scores"]).abs().max().item() if len(a["scores"]) else 0.0
        if not torch.allclose(b["boxes"], a["boxes"], rtol=1e-3, atol=1e-3):
            return False, f"image {i}: boxes differ by up to {box_err:.2e}"
        if score_err > 1e-4:
            return False, f"image {i}: scores differ by up to {score_err:.2e}"
        if "masks" in a and len(a["masks"]):
            ma, mb = a["masks"] > 0.5, b["masks"] > 0.5
            inter = (ma & mb).flatten(1).sum(1).float()
            union = (ma | mb).flatten(1).sum(1).float()
            ious.append(torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union)))
    if total == 0:
        return False, "no detections: the comparison is empty"
    msg = f"{total} detections agree"
    if ious:
        iou = torch.cat(ious)
        msg += f", mask IoU min {iou.min().item():.4f} mean {iou.mean().item():.4f}"
    return True, msg


# --- timing ---------------------------------------------------------------------------------


def _infer(model: nn.Module, images: List[Tensor]):
    with torch.no_grad():
        return model(images)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, images: List[Tensor], targets) -> None:
    losses = model(images, targets)
    loss = sum(losses.values())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.SGD(params, lr=0.0, momentum=0.9, weight_decay=1e-4)


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _time(fn, device: str, quick: bool) -> Optional[float]:
    """Median ms of fn(), or None (printed) when it runs out of memory."""
    kw = dict(warmup=1, runs=3, max_seconds=30.0) if device == "cpu" else dict(warmup=3, runs=10, max_seconds=30.0)
    if quick and device == "cpu":
        kw = dict(warmup=1, runs=2, max_seconds=30.0)
    try:
        return median_ms(fn, device, **kw)
    except torch.cuda.OutOfMemoryError as e:  # noqa: PERF203
        print(f"  out of memory: {str(e).splitlines()[0]}", flush=True)
        return None
    finally:
        _free(device)


def run(devices: List[str], quick: bool = False, batches: Optional[List[int]] = None,
        modes: Tuple[str, ...] = ("inference", "training")) -> List[Row]:
    """Rows for (inference, training) x batches on each device. Full-size CPU cases take
    minutes, so CPU runs only with quick=True."""
    rows: List[Row] = []
    for device in devices:
        if device == "cpu" and not quick:
            continue
        height, width = (QUICK_HEIGHT, QUICK_WIDTH) if quick else (HEIGHT, WIDTH)
        batch_sizes = batches or ([1, 2] if quick else [2, 8])
        tv, dt = build_models(device, height, width)

        tv.eval(), dt.eval()
        images = make_images(2, height, width, device)
        ok, msg = compare_detections(_infer(tv, images), _infer(dt, images))
        print(f"  parity ({device}, {height}x{width}, batch 2): {'ok' if ok else 'MISMATCH'}: {msg}", flush=True)
        del images
        _free(device)

        for mode in modes:
            for batch in batch_sizes:
                case = f"mask_rcnn R-50-FPN {mode}, batch {batch}, {height}x{width}, fp32"
                try:
                    images = make_images(batch, height, width, device)
                    if mode == "inference":
                        tv.eval(), dt.eval()
                        t_tv = _time(lambda: _infer(tv, images), device, quick)
                        t_dt = _time(lambda: _infer(dt, images), device, quick)
                        dt.memory_format = "channels_last"
                        t_cl = _time(lambda: _infer(dt, images), device, quick)
                    else:
                        targets = make_targets(batch, height, width, device)
                        tv.train(), dt.train()
                        opt_tv, opt_dt = _sgd(tv), _sgd(dt)
                        t_tv = _time(lambda: _train_step(tv, opt_tv, images, targets), device, quick)
                        t_dt = _time(lambda: _train_step(dt, opt_dt, images, targets), device, quick)
                        dt.memory_format = "channels_last"
                        t_cl = _time(lambda: _train_step(dt, opt_dt, images, targets), device, quick)
                        del targets, opt_tv, opt_dt
                except torch.cuda.OutOfMemoryError as e:
                    print(f"  {case}: out of memory while preparing: {str(e).splitlines()[0]}", flush=True)
                    t_tv = t_dt = t_cl = None
                finally:
                    dt.memory_format = "contiguous"
                    images = None
                    for m in (tv, dt):
                        m.zero_grad(set_to_none=True)
                    _free(device)
                if t_dt is None:
                    print(f"| {case} | {'OOM' if t_tv is None else f'{t_tv:.2f} ms'} | OOM | n/a | |", flush=True)
                    continue
                row = Row(case, device, t_dt, t_tv)
                print(format_row(row) + f"  ({batch * 1e3 / t_dt:.1f} img/s detops"
                      + (f", {batch * 1e3 / t_tv:.1f} img/s torchvision)" if t_tv else ")"), flush=True)
                rows.append(row)
                if t_cl is not None:
                    row = Row(case.replace(", fp32", ", fp32, detops channels_last"), device, t_cl, t_tv)
                    print(format_row(row) + f"  ({batch * 1e3 / t_cl:.1f} img/s detops)", flush=True)
                    rows.append(row)
        del tv, dt
        _free(device)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda", "all"], default="cuda")
    p.add_argument("--quick", action="store_true", help=f"{QUICK_HEIGHT}x{QUICK_WIDTH} images, batch 1 and 2")
    p.add_argument("--batch", type=int, nargs="*", help="batch sizes (default: 2 8, or 1 2 with --quick)")
    p.add_argument("--mode", choices=["inference", "training"], nargs="*", default=["inference", "training"])
    a = p.parse_args()
    devices = ["cpu", "cuda"] if a.device == "all" else [a.device]
    if "cuda" in devices and not torch.cuda.is_available():
        print("no CUDA device: running the quick CPU case instead")
        devices, a.quick = ["cpu"], True
    print(HEADER)
    run(devices, quick=a.quick, batches=a.batch, modes=tuple(a.mode))


if __name__ == "__main__":
    main()
