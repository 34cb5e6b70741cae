"""detops: detection operators for PyTorch (NMS, RoIAlign, RoIPool, ...) in C++ and CUDA.

`detops.ops` mirrors `torchvision.ops`; every op runs on CPU or CUDA by its tensors' device.
"""
import torch  # noqa: F401  (loads libtorch before the extension that links against it)

from ._extension import load as _load

_C = _load()

from . import ops  # noqa: E402
from .jit import aot_library_path  # noqa: E402

try:
    from ._build_info import version as __version__
except ImportError:  # built by other means
    __version__ = "0.1.0"

__all__ = ["ops", "aot_library_path", "__version__"]
