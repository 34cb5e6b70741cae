"""Pictures: detections drawn on images, and the training loss curve (matplotlib, Agg)."""
from __future__ import annotations

import os
from typing import Dict, List, Sequence

import numpy as np
import torch


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_COLOURS = np.array([[0.9, 0.1, 0.1], [0.1, 0.8, 0.1], [0.1, 0.3, 0.95], [0.95, 0.8, 0.1], [0.8, 0.1, 0.8],
                     [0.1, 0.85, 0.85], [1.0, 0.5, 0.0], [0.5, 0.3, 0.1]])


def draw_detections(image: torch.Tensor, prediction: Dict[str, torch.Tensor], class_names: Sequence[str],
                    path: str, score_thresh: float = 0.5, title: str = "") -> str:
    """Save `image` ([3, H, W] float in [0, 1]) with the boxes, labels, scores and masks of
    `prediction` (scores >= score_thresh) drawn on it as a PNG at `path`."""
    plt = _plt()
    img = image.detach().cpu().permute(1, 2, 0).clamp(0, 1).numpy().copy()
    keep = prediction["scores"].cpu() >= score_thresh
    boxes = prediction["boxes"].cpu()[keep]
    labels = prediction["labels"].cpu()[keep]
    scores = prediction["scores"].cpu()[keep]
    masks = prediction["masks"].cpu()[keep] if "masks" in prediction else None
    for i in range(len(boxes)):
        c = _COLOURS[int(labels[i]) % len(_COLOURS)]
        if masks is not None:
            m = masks[i, 0].float().numpy() > 0.5
            img[m] = 0.55 * img[m] + 0.45 * c
    h, w = img.shape[:2]
    fig = plt.figure(figsize=(max(w, 160) / 40, max(h, 160) / 40), dpi=80)
    ax = fig.add_axes([0, 0, 1, 1])
    ax.imshow(img)
    ax.axis("off")
    for i in range(len(boxes)):
        x1, y1, x2, y2 = boxes[i].tolist()
        c = _COLOURS[int(labels[i]) % len(_COLOURS)]
        ax.add_patch(plt.Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, edgecolor=c, linewidth=1.5))
        name = class_names[int(labels[i])] if int(labels[i]) < len(class_names) else str(int(labels[i]))
        ax.text(x1, max(y1 - 2, 6), f"{name} {float(scores[i]):.2f}", color="white", fontsize=7,
                bbox=dict(facecolor=c, alpha=0.7, pad=1, edgecolor="none"))
    if title:
        ax.text(2, h - 3, title, color="white", fontsize=6, bbox=dict(facecolor="black", alpha=0.5, pad=1))
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loss_curve(history: List[Dict[str, float]], path: str) -> str:
    """Total loss and each loss term per iteration (with a moving average) as a PNG."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    if history:
        its = np.array([h["iter"] for h in history])
        keys = ["loss"] + sorted(k for k in history[0] if k.startswith("loss_"))
        win = max(1, len(history) // 50)
        for k in keys:
            v = np.array([h.get(k, np.nan) for h in history], dtype=float)
            smooth = np.convolve(v, np.ones(win) / win, mode="valid") if len(v) >= win else v
            ax.plot(its[len(its) - len(smooth):], smooth, label=k, linewidth=2 if k == "loss" else 1)
        ax.set_yscale("log")
        ax.legend()
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (moving average)")
    ax.set_title("training loss")
    ax.grid(True, alpha=0.3)
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
