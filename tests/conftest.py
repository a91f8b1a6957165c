import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _sglang_cpu import ensure_sglang_importable  # noqa: E402

ensure_sglang_importable()
