"""Make SGLang's pure-Python modules importable on a CPU-only test machine.

``sglang/srt/utils/common.py`` imports ``torchvision.io.decode_jpeg`` at module level (for image
inputs). No CPU build of torchvision exists for the CPU torch these tests install, and the CUDA
build cannot load there. So when torchvision is missing, a module holding only ``decode_jpeg``
(raising if called) stands in while ``sglang.srt.utils`` is imported, and is removed from
``sys.modules`` right after, so other libraries (transformers) still see no torchvision. No test
decodes images; every SGLang function the tests use is the real one.
"""

import importlib.machinery
import importlib.util
import sys
import types


def ensure_sglang_importable() -> None:
    """Import ``sglang.srt.utils`` with the torchvision stand-in if torchvision cannot be found."""
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return

    def decode_jpeg(*args, **kwargs):
        raise RuntimeError("torchvision is not installed in the CPU test environment")

    tv = types.ModuleType("torchvision")
    io = types.ModuleType("torchvision.io")
    # transformers (imported by sglang/__init__.py from 0.5.12) asks importlib for the spec of every
    # module it finds in sys.modules: a stand-in without one makes it raise ValueError
    tv.__spec__ = importlib.machinery.ModuleSpec("torchvision", None)
    io.__spec__ = importlib.machinery.ModuleSpec("torchvision.io", None)
    io.decode_jpeg = decode_jpeg
    tv.io = io
    sys.modules["torchvision"] = tv
    sys.modules["torchvision.io"] = io
    try:
        import sglang.srt.utils  # noqa: F401
    finally:
        del sys.modules["torchvision"], sys.modules["torchvision.io"]
