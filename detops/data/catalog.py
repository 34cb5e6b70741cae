"""Dataset names -> datasets.

    shapes_train, shapes_val          the synthetic shapes dataset (DATASETS.SHAPES.*)
    coco_2017_train, coco_2017_val    DATASETS.DATA_DIR/coco/{train2017,val2017} and
                                      DATASETS.DATA_DIR/coco/annotations/instances_*2017.json
    any name in DATASETS.COCO_ROOTS   [name, image folder, annotation JSON]
    any name given to register_coco   (from Python)
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

_REGISTERED: Dict[str, Tuple[str, str]] = {}

_STANDARD = {
    "coco_2017_train": ("coco/train2017", "coco/annotations/instances_train2017.json"),
    "coco_2017_val": ("coco/val2017", "coco/annotations/instances_val2017.json"),
    "coco_2014_train": ("coco/train2014", "coco/annotations/instances_train2014.json"),
    "coco_2014_val": ("coco/val2014", "coco/annotations/instances_val2014.json"),
}

SHAPES_SPLITS = {"shapes_train": 0, "shapes_val": 1}


def register_coco(name: str, img_dir: str, ann_file: str) -> None:
    """Make `name` usable in DATASETS.TRAIN / DATASETS.TEST."""
    _REGISTERED[name] = (img_dir, ann_file)


def coco_paths(cfg, name: str) -> Tuple[str, str, str]:
    """(image folder, annotation JSON, the config key that gave them) of a COCO-format name."""
    for entry in cfg.DATASETS.COCO_ROOTS:
        if len(entry) != 3:
            raise ValueError(f"DATASETS.COCO_ROOTS: each entry must be [name, image folder, annotation JSON], got {entry!r}")
        if entry[0] == name:
            return entry[1], entry[2], "DATASETS.COCO_ROOTS"
    if name in _REGISTERED:
        return _REGISTERED[name] + ("detops.data.register_coco",)
    if name in _STANDARD:
        d, a = _STANDARD[name]
        return os.path.join(cfg.DATASETS.DATA_DIR, d), os.path.join(cfg.DATASETS.DATA_DIR, a), "DATASETS.DATA_DIR"
    known = sorted(set(SHAPES_SPLITS) | set(_STANDARD) | set(_REGISTERED) | {e[0] for e in cfg.DATASETS.COCO_ROOTS})
    raise KeyError(f"unknown dataset {name!r} in DATASETS.TRAIN / DATASETS.TEST; known names: {known} "
                   f"(add yours to DATASETS.COCO_ROOTS as [name, image folder, annotation JSON])")
