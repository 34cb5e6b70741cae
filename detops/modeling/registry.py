"""Registries: config names -> classes or builder functions.

    BACKBONES = Registry("BACKBONES")

    @BACKBONES.register("R-50-FPN")
    def build_resnet_fpn(cfg): ...

    BACKBONES["R-50-FPN"](cfg)
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, Optional


class Registry:
    """A named table of classes or functions; looking up an unknown name raises a KeyError
    that lists the known ones."""

    def __init__(self, name: str):
        self.name = name
        self._entries: Dict[str, Callable] = {}

    def register(self, name: Optional[str] = None, obj: Optional[Callable] = None):
        """Register `obj` under `name` (default: its __name__). Without `obj`, a decorator."""
        if obj is not None:
            self._add(name or obj.__name__, obj)
            return obj

        def deco(fn: Callable) -> Callable:
            self._add(name or fn.__name__, fn)
            return fn

        return deco

    def _add(self, name: str, obj: Callable) -> None:
        if name in self._entries:
            raise KeyError(f"{self.name}: {name!r} is already registered")
        self._entries[name] = obj

    def __getitem__(self, name: str) -> Callable:
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "(none)"
            raise KeyError(f"{self.name}: unknown name {name!r}; registered names are: {known}")
        return self._entries[name]

    get = __getitem__

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.name}: {sorted(self._entries)})"


BACKBONES = Registry("BACKBONES")
RPN_HEADS = Registry("RPN_HEADS")
ROI_BOX_FEATURE_EXTRACTORS = Registry("ROI_BOX_FEATURE_EXTRACTORS")
ROI_BOX_PREDICTOR = Registry("ROI_BOX_PREDICTOR")
ROI_MASK_FEATURE_EXTRACTORS = Registry("ROI_MASK_FEATURE_EXTRACTORS")
ROI_MASK_PREDICTOR = Registry("ROI_MASK_PREDICTOR")
META_ARCH_REGISTRY = Registry("META_ARCHITECTURES")
