"""GPU tests: selected with ``pytest -m gpu``; skipped where CUDA or SGLang's kernels are absent."""

import importlib.util

import pytest
import torch


def _missing():
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    for mod in ("sgl_kernel", "torch_memory_saver", "sglang"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _missing()
    for item in items:
        if "/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
