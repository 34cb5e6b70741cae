"""Loading detops._C and the messages users get when the build does not fit."""
import importlib
import warnings

import pytest
import torch

import detops
from detops import _extension
from detops.testing import registered_ops


# What every registered op needs: a CPU kernel, a CUDA kernel (in a CPU-only build, the entry
# that explains how to rebuild) and a fake kernel for torch.compile / export (Meta).
KERNEL_KEYS = ("CPU", "CUDA", "Meta")


def missing_kernels(namespace="detops"):
    """(op, dispatch key) for every op of `namespace` without a kernel for one of KERNEL_KEYS."""
    return [
        (name, key)
        for name in registered_ops(namespace)
        for key in KERNEL_KEYS
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"{namespace}::{name}", key)
    ]


def test_import_loads_torch_and_ops():
    assert detops._C.torch_version().split(".")[:2] == torch.__version__.split("+")[0].split(".")[:2]
    names = registered_ops()
    # every op function of detops.ops is a registered op
    assert {n for n in detops.ops.__all__ if n.islower()} <= set(names), names
    for name in names:
        assert hasattr(torch.ops.detops, name)
    assert missing_kernels() == []


def test_an_op_without_its_kernels_is_found():
    """The check above covers an op as soon as its schema is registered: one defined with only a
    CPU kernel is reported for CUDA and Meta."""
    lib = torch.library.Library("detops_probe", "DEF")
    try:
        lib.define("probe(Tensor x) -> Tensor")
        lib.impl("probe", lambda x: x.clone(), "CPU")
        assert registered_ops("detops_probe") == ["probe"]
        assert missing_kernels("detops_probe") == [("probe", "CUDA"), ("probe", "Meta")]
    finally:
        lib._destroy()


def test_mismatched_build_explains_and_gives_the_rebuild_command(monkeypatch):
    def broken(name):
        raise ImportError("/x/detops/_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKc")

    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(ImportError) as info:
        _extension.load()
    text = str(info.value)
    assert "does not match the torch that is running" in text
    assert "built against:" in text and f"torch {torch.__version__}" in text
    assert "pip install -e . --no-build-isolation" in text
    assert "undefined symbol" in text


def test_missing_build_says_build_it(monkeypatch):
    def missing(name):
        raise ImportError("No module named 'detops._C'")

    monkeypatch.setattr(importlib, "import_module", missing)
    monkeypatch.setenv("DETOPS_JIT", "0")
    with pytest.raises(ImportError, match="it has not been built"):
        _extension.load()


def test_missing_build_falls_back_to_jit_with_a_message(monkeypatch):
    import sys

    from detops import jit

    def missing(name):
        raise ImportError("No module named 'detops._C'")

    sentinel = object()
    monkeypatch.setattr(importlib, "import_module", missing)
    monkeypatch.setattr(jit, "load", lambda verbose=False: sentinel)
    monkeypatch.setitem(sys.modules, "detops._C", sys.modules.get("detops._C"))
    monkeypatch.delenv("DETOPS_JIT", raising=False)
    with pytest.warns(RuntimeWarning, match="no prebuilt detops._C was found.*detops.jit.load"):
        assert _extension.load() is sentinel


def test_mismatched_build_is_not_replaced_by_jit(monkeypatch):
    from detops import jit

    def broken(name):
        raise ImportError("/x/detops/_C.so: undefined symbol: _ZN3c106detail14torchCheckFailEPKc")

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(jit, "load", lambda verbose=False: pytest.fail("JIT used for a mismatched build"))
    monkeypatch.delenv("DETOPS_JIT", raising=False)
    with pytest.raises(ImportError, match="does not match"):
        _extension.load()


def test_version_skew_warns(monkeypatch):
    class Fake:
        @staticmethod
        def torch_version():
            return "1.0.0"

    monkeypatch.setattr(importlib, "import_module", lambda name: Fake)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _extension.load()
    assert any("built against torch 1.0.0" in str(w.message) for w in caught)


def test_cuda_kernel_reached_with_wrong_tensors_explains():
    # Call the CUDA registration directly with CPU tensors: a CUDA build rejects the device, a
    # CPU-only build says it has no CUDA kernels and how to rebuild.
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
    boxes, scores = torch.rand(3, 4), torch.rand(3)
    expected = "must be a CUDA tensor" if detops._C.with_cuda() else "built without CUDA kernels.*FORCE_CUDA=1"
    with pytest.raises(RuntimeError, match="detops.nms: .*" + expected):
        torch.ops.detops.nms.default.redispatch(keyset, boxes, scores, 0.5)


def test_error_checks_build_their_messages_without_ostream():
    """TORCH_CHECK formats its message's numbers through std::ostream, which crashes the process
    with some pairings of a torch wheel and the system's libstdc++ (csrc/common/checks.h). Every
    check in csrc goes through DETOPS_CHECK, whose message never touches an ostream."""
    import os
    import re

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            if not name.endswith((".h", ".cpp", ".cu", ".cuh")):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                for number, line in enumerate(f, 1):
                    code = line.split("//", 1)[0]
                    if re.search(r"\bTORCH_CHECK(_[A-Z]+)?\s*\(", code) and "#define DETOPS_CHECK" not in code:
                        found.append(f"{os.path.relpath(path, root)}:{number}: {line.strip()}")
    assert not found, "TORCH_CHECK outside DETOPS_CHECK:\n" + "\n".join(found)
