"""Datasets (synthetic shapes, COCO format), transforms and data loaders."""
from .build import IterationBatchSampler, build_dataset, collate, make_test_loaders, make_train_loader
from .catalog import register_coco
from .coco import COCODataset
from .coco_utils import coco_from_annotations, encode_masks
from .shapes import ShapesDataset, make_shapes_image

__all__ = ["COCODataset", "IterationBatchSampler", "ShapesDataset", "build_dataset", "coco_from_annotations",
           "collate", "encode_masks", "make_shapes_image", "make_test_loaders", "make_train_loader", "register_coco"]
