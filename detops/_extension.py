"""Loading detops._C, with one clear message when it does not fit the running torch."""
from __future__ import annotations

import importlib
import warnings

import torch

REBUILD = "pip install -e . --no-build-isolation   (or: python setup.py develop)"


def _build_info():
    try:
        from . import _build_info as info  # written by setup.py
    except ImportError:
        return None
    return info


def _built_desc(info) -> str:
    if info is None:
        return "an unknown torch (no detops/_build_info.py)"
    cuda = f"CUDA {info.torch_cuda}" if info.with_cuda else "CPU only"
    return f"torch {info.torch_version} ({cuda})"


def _running_desc() -> str:
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
    return f"torch {torch.__version__} ({cuda})"


def _release(version: str) -> str:
    return version.split("+")[0]


def load():
    """Import and return detops._C, or raise ImportError saying what was built, what runs,
    and how to rebuild."""
    info = _build_info()
    try:
        module = importlib.import_module("detops._C")
    except ImportError as exc:
        text = str(exc)
        if "undefined symbol" in text or "version" in text.lower() or "cannot open shared" in text:
            cause = "it does not match the torch that is running"
        elif "No module named" in text:
            cause = "it has not been built"
        else:
            cause = "it could not be loaded"
        raise ImportError(
            f"detops._C cannot be imported: {cause}.\n"
            f"  built against: {_built_desc(info)}\n"
            f"  running:       {_running_desc()}\n"
            f"  rebuild from the detops checkout with: {REBUILD}\n"
            f"  (loader said: {text})"
        ) from exc
    built = module.torch_version()
    if _release(built) != _release(torch.__version__):
        warnings.warn(
            f"detops._C was built against torch {built} but torch {torch.__version__} is running; "
            f"ops may fail or misbehave. Rebuild with: {REBUILD}",
            RuntimeWarning,
            stacklevel=3,
        )
    return module
