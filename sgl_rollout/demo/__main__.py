"""``python -m sgl_rollout.demo``: the same as ``python -m sgl_rollout demo``."""

import sys

from . import main

if __name__ == "__main__":  # SGLang spawns its scheduler, which re-imports the main module
    sys.exit(main())
