"""BoxList: the boxes of one image, with per-box fields (labels, scores, masks, ...)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor

_MODES = ("xyxy", "xywh")


class BoxList:
    """Boxes of one image of size (width, height), in "xyxy" (x1, y1, x2, y2) or "xywh" mode.

    Widths are x2 - x1 (torchvision's convention, no "+ 1"). Extra per-box data lives in
    fields: ``boxlist.add_field("labels", labels)``; indexing a BoxList indexes every field.

    Args:
        bbox (Tensor[N, 4]): the boxes.
        image_size ((int, int)): (width, height) of the image.
        mode (str): "xyxy" or "xywh".
    """

    def __init__(self, bbox: Any, image_size: Tuple[int, int], mode: str = "xyxy"):
        device = bbox.device if isinstance(bbox, Tensor) else torch.device("cpu")
        bbox = torch.as_tensor(bbox, dtype=torch.float32 if not isinstance(bbox, Tensor) else None, device=device)
        if bbox.numel() == 0:
            bbox = bbox.reshape(0, 4)
        if bbox.dim() != 2 or bbox.size(-1) != 4:
            raise ValueError(f"BoxList: bbox must be a [N, 4] tensor, got {list(bbox.shape)}")
        if mode not in _MODES:
            raise ValueError(f"BoxList: mode must be one of {_MODES}, got {mode!r}")
        self.bbox = bbox
        self.size = (int(image_size[0]), int(image_size[1]))
        self.mode = mode
        self.extra_fields: Dict[str, Any] = {}

    # fields
    def add_field(self, field: str, data: Any) -> None:
        self.extra_fields[field] = data

    def get_field(self, field: str) -> Any:
        if field not in self.extra_fields:
            raise KeyError(f"BoxList has no field {field!r} (fields: {self.fields()})")
        return self.extra_fields[field]

    def has_field(self, field: str) -> bool:
        return field in self.extra_fields

    def fields(self):
        return list(self.extra_fields.keys())

    def _copy_extra_fields(self, other: "BoxList") -> None:
        for k, v in other.extra_fields.items():
            self.extra_fields[k] = v

    # geometry
    def convert(self, mode: str) -> "BoxList":
        """The same boxes in another mode (fields are shared)."""
        if mode not in _MODES:
            raise ValueError(f"BoxList.convert: mode must be one of {_MODES}, got {mode!r}")
        if mode == self.mode:
            return self
        x1, y1, a, b = self.bbox.unbind(-1)
        if mode == "xyxy":  # from xywh
            bbox = torch.stack([x1, y1, x1 + a, y1 + b], dim=-1)
        else:
            bbox = torch.stack([x1, y1, a - x1, b - y1], dim=-1)
        out = BoxList(bbox, self.size, mode=mode)
        out._copy_extra_fields(self)
        return out

    def _xyxy(self) -> Tensor:
        return self.convert("xyxy").bbox

    def resize(self, size: Tuple[int, int]) -> "BoxList":
        """Boxes of this image resized to `size` (width, height); fields that know how to
        resize (have a `resize` method) are resized too."""
        ratio_w = torch.tensor(float(size[0]), dtype=torch.float32, device=self.bbox.device) / float(self.size[0])
        ratio_h = torch.tensor(float(size[1]), dtype=torch.float32, device=self.bbox.device) / float(self.size[1])
        x1, y1, x2, y2 = self._xyxy().unbind(-1)
        bbox = torch.stack([x1 * ratio_w, y1 * ratio_h, x2 * ratio_w, y2 * ratio_h], dim=-1)
        out = BoxList(bbox, size, mode="xyxy")
        for k, v in self.extra_fields.items():
            out.add_field(k, v.resize(size) if hasattr(v, "resize") and not isinstance(v, Tensor) else v)
        return out.convert(self.mode)

    def clip_to_image(self, remove_empty: bool = True) -> "BoxList":
        """Boxes clipped to the image; with remove_empty, boxes left with no area are dropped."""
        w, h = self.size
        b = self._xyxy()
        x = b[:, 0::2].clamp(min=0, max=w)
        y = b[:, 1::2].clamp(min=0, max=h)
        bbox = torch.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], dim=-1)
        out = BoxList(bbox, self.size, mode="xyxy")
        out._copy_extra_fields(self)
        if remove_empty:
            keep = (bbox[:, 2] > bbox[:, 0]) & (bbox[:, 3] > bbox[:, 1])
            out = out[keep]
        return out.convert(self.mode)

    def area(self) -> Tensor:
        b = self._xyxy()
        return (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])

    def to(self, device) -> "BoxList":
        out = BoxList(self.bbox.to(device), self.size, self.mode)
        for k, v in self.extra_fields.items():
            out.add_field(k, v.to(device) if hasattr(v, "to") else v)
        return out

    def __getitem__(self, item) -> "BoxList":
        out = BoxList(self.bbox[item], self.size, self.mode)
        for k, v in self.extra_fields.items():
            out.add_field(k, v[item])
        return out

    def __len__(self) -> int:
        return self.bbox.shape[0]

    def copy_with_fields(self, fields, skip_missing: bool = False) -> "BoxList":
        out = BoxList(self.bbox, self.size, self.mode)
        for f in [fields] if isinstance(fields, str) else fields:
            if self.has_field(f):
                out.add_field(f, self.get_field(f))
            elif not skip_missing:
                raise KeyError(f"BoxList has no field {f!r} (fields: {self.fields()})")
        return out

    def __repr__(self) -> str:
        return (
            f"BoxList(num_boxes={len(self)}, image_width={self.size[0]}, image_height={self.size[1]}, "
            f"mode={self.mode}, fields={self.fields()})"
        )
