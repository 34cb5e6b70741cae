import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def cuda_param(value="cuda"):
    """A pytest.param for the CUDA variant of a device-parametrized test."""
    return pytest.param(value, marks=pytest.mark.cuda)


DEVICES = ["cpu", cuda_param()]


@pytest.fixture(scope="session")
def torch_extensions_dir(tmp_path_factory):
    """One TORCH_EXTENSIONS_DIR for the JIT builds of a test session, so each builds once."""
    return tmp_path_factory.mktemp("torch_extensions")
