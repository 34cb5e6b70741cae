"""Loading detops._C, with one clear message when it does not fit the running torch.

When no prebuilt detops._C exists (a source checkout that was never built), `import detops`
builds the extension from csrc/ with `detops.jit.load()` and says so. DETOPS_JIT selects:
  unset or "auto"  use the prebuilt detops._C; build with the JIT only when it does not exist
  "1"              always use the JIT build, even when a prebuilt detops._C exists
  "0"              never build: a missing detops._C is an ImportError with the build command
A detops._C that exists but does not load (built against another torch: undefined symbol, ...)
is never replaced silently: the error says what was built, what runs, and how to rebuild.
"""
from __future__ import annotations

import importlib
import os
import sys
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


def _jit_mode() -> str:
    mode = os.environ.get("DETOPS_JIT", "auto").strip().lower()
    if mode in ("1", "true", "yes", "on"):
        return "always"
    if mode in ("0", "false", "no", "off"):
        return "never"
    return "auto"


def _load_jit(reason: str):
    from . import jit

    warnings.warn(
        f"detops: {reason}; building it from csrc/ with detops.jit.load() (the first build "
        "takes a few minutes, later imports reuse it; DETOPS_JIT=0 turns this off)",
        RuntimeWarning,
        stacklevel=3,
    )
    module = jit.load()
    sys.modules["detops._C"] = module
    return module


def load():
    """Import and return detops._C (or its JIT build, see the module docstring), or raise
    ImportError saying what was built, what runs, and how to rebuild."""
    mode = _jit_mode()
    if mode == "always":
        return _load_jit("DETOPS_JIT=1 asks for the JIT build")
    info = _build_info()
    try:
        module = importlib.import_module("detops._C")
    except ImportError as exc:
        text = str(exc)
        if "undefined symbol" in text or "version" in text.lower() or "cannot open shared" in text:
            cause = "it does not match the torch that is running"
        elif "No module named" in text:
            if mode == "auto":
                return _load_jit("no prebuilt detops._C was found")
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
