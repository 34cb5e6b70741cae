"""Datasets and data loaders from a config.

Training batches are a pure function of (SEED, iteration): the sample stream is the
concatenation of per-epoch permutations seeded by (SEED, epoch), iteration i takes positions
[i * IMS_PER_BATCH, (i + 1) * IMS_PER_BATCH) of it, and each sample's augmentations are seeded by
(SEED, position). A run resumed at iteration i therefore sees exactly the batches an
uninterrupted run would. Under torch.distributed each process takes its share of every global
batch (the IMS_PER_BATCH images are split over the processes); evaluation uses a
DistributedSampler.
"""
from __future__ import annotations

import logging
import os
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist

from .catalog import SHAPES_SPLITS, coco_paths
from .coco import COCODataset
from .shapes import ShapesDataset
from .transforms import build_transforms

logger = logging.getLogger("detops.data")


def _dist_info():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def build_dataset(cfg, name: str, is_train: bool):
    """The dataset called `name` (see detops.data.catalog), with the train or test transforms."""
    transforms = build_transforms(cfg, is_train)
    if name in SHAPES_SPLITS:
        s = cfg.DATASETS.SHAPES
        n = s.NUM_TRAIN if name == "shapes_train" else s.NUM_VAL
        # the split index is mixed into the seed: train and val never share an image
        return ShapesDataset(n, seed=s.SEED * 2 + SHAPES_SPLITS[name], image_size=s.IMAGE_SIZE,
                             min_objects=s.MIN_OBJECTS, max_objects=s.MAX_OBJECTS, min_obj_size=s.MIN_OBJ_SIZE,
                             max_obj_size=s.MAX_OBJ_SIZE, transforms=transforms, name=name)
    img_dir, ann_file, key = coco_paths(cfg, name)
    for what, path in (("image folder", img_dir), ("annotation file", ann_file)):
        if not os.path.exists(path):
            raise FileNotFoundError(f"dataset {name!r}: {what} {path!r} does not exist (set by {key}; "
                                    f"working directory {os.getcwd()!r})")
    return COCODataset(img_dir, ann_file, transforms=transforms, remove_images_without_annotations=is_train, name=name)


def collate(batch):
    """(list of images, list of targets), leaving out samples that could not be read (None)."""
    batch = [b for b in batch if b is not None]
    return [b[0] for b in batch], [b[1] for b in batch]


class IterationBatchSampler(torch.utils.data.Sampler):
    """Batches for iterations start_iter..max_iter-1 as lists of (index, aug_seed); this process's
    share (rank::world_size) of each global batch of `batch_size` samples."""

    def __init__(self, size: int, batch_size: int, seed: int, start_iter: int, max_iter: int,
                 rank: int = 0, world_size: int = 1):
        if batch_size % world_size:
            raise ValueError(f"SOLVER.IMS_PER_BATCH ({batch_size}) must be divisible by the number of processes "
                             f"({world_size})")
        self.size, self.batch_size, self.seed = size, batch_size, seed
        self.start_iter, self.max_iter = start_iter, max_iter
        self.rank, self.world_size = rank, world_size
        self._perm_epoch, self._perm = -1, None

    def _perm_of(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self._perm, self._perm_epoch = torch.randperm(self.size, generator=g), epoch
        return self._perm

    def batch(self, iteration: int) -> List[tuple]:
        out = []
        for j in range(self.rank, self.batch_size, self.world_size):
            pos = iteration * self.batch_size + j
            idx = int(self._perm_of(pos // self.size)[pos % self.size])
            out.append((idx, (self.seed * 1000003 + pos) % (2 ** 62)))
        return out

    def __iter__(self) -> Iterator[List[tuple]]:
        for it in range(self.start_iter, self.max_iter):
            yield self.batch(it)

    def __len__(self) -> int:
        return max(self.max_iter - self.start_iter, 0)


class _Concat(torch.utils.data.Dataset):
    """Datasets one after the other; items may be index or (index, aug_seed)."""

    def __init__(self, datasets):
        self.datasets = datasets
        self.offsets = [0]
        for d in datasets:
            self.offsets.append(self.offsets[-1] + len(d))

    def __len__(self):
        return self.offsets[-1]

    def __getitem__(self, item):
        index, aug = item if isinstance(item, tuple) else (item, None)
        for k, d in enumerate(self.datasets):
            if index < self.offsets[k + 1]:
                return d[(index - self.offsets[k], aug)]
        raise IndexError(index)


def make_train_loader(cfg, start_iter: int = 0, max_iter: Optional[int] = None):
    names = list(cfg.DATASETS.TRAIN)
    if not names:
        raise ValueError("DATASETS.TRAIN is empty: name a training dataset (e.g. (\"shapes_train\",))")
    datasets = [build_dataset(cfg, n, True) for n in names]
    dataset = datasets[0] if len(datasets) == 1 else _Concat(datasets)
    rank, world = _dist_info()
    sampler = IterationBatchSampler(len(dataset), cfg.SOLVER.IMS_PER_BATCH, cfg.SEED, start_iter,
                                    cfg.SOLVER.MAX_ITER if max_iter is None else max_iter, rank, world)
    # the loader's own generator: iterating it must not draw from the global RNG, whose state a
    # checkpoint restores (the batch order and augmentations come from the sampler)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, collate_fn=collate,
                                       num_workers=cfg.DATALOADER.NUM_WORKERS,
                                       generator=torch.Generator().manual_seed(cfg.SEED))


def make_test_loaders(cfg):
    """[(name, dataset, loader)] for every DATASETS.TEST name."""
    rank, world = _dist_info()
    out = []
    for name in cfg.DATASETS.TEST:
        ds = build_dataset(cfg, name, False)
        if world > 1:
            sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
        else:
            sampler = torch.utils.data.SequentialSampler(ds)
        per_proc = max(1, cfg.TEST.IMS_PER_BATCH // world)
        loader = torch.utils.data.DataLoader(ds, batch_size=per_proc, sampler=sampler, collate_fn=collate,
                                             num_workers=cfg.DATALOADER.NUM_WORKERS,
                                             generator=torch.Generator().manual_seed(cfg.SEED))
        out.append((name, ds, loader))
    return out
