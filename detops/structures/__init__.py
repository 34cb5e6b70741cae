"""Containers the detector passes between its parts: boxes with fields, and padded image batches."""
from .bounding_box import BoxList
from .boxlist_ops import boxlist_iou, cat_boxlist, remove_small_boxes
from .image_list import ImageList, to_image_list

__all__ = ["BoxList", "ImageList", "to_image_list", "boxlist_iou", "cat_boxlist", "remove_small_boxes"]
