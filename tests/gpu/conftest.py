"""GPU tests: selected with ``pytest -m gpu``; skipped where CUDA or SGLang's kernels are absent.

``SGLROLLOUT_GPU_FAST_SYNC=0`` runs them with ``RolloutConfig.fast_sync`` off by default, ``=1`` on (the
package's default; a config that sets it keeps its value): the worker's GPU suite on the flattened
buckets or on the fast-path weight sync.
"""

import contextlib
import importlib.util
import os

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


def pytest_unconfigure(config):
    """If the GPU suite's process is still alive 60 s after pytest is done, print every thread's stack
    and exit: a process that cannot exit (a trainer that hangs after training) is a bug to see, not wait on."""
    import faulthandler
    import sys
    import threading

    if getattr(config, "_sgl_rollout_fast_sync", None) is not None:
        config._sgl_rollout_fast_sync.close()

    if torch.cuda.is_available():
        alive = [f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate()]
        print(f"\nthreads at exit: {alive}", file=sys.stderr)
        faulthandler.dump_traceback_later(60, exit=True)


@pytest.fixture(autouse=True)
def _dump_stacks_if_a_test_hangs():
    """Print every thread's stack and exit if one GPU test (teardown included) runs past 300 s, so a
    hang shows where it is instead of ending in the caller's timeout."""
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@contextlib.contextmanager
def fast_sync_default(on: bool):
    """Inside, ``RolloutConfig(...)`` without ``fast_sync`` gets ``fast_sync=on``; the default is restored after."""
    from sgl_rollout.config import RolloutConfig

    field = RolloutConfig.model_fields["fast_sync"]
    before, field.default = field.default, on
    RolloutConfig.model_rebuild(force=True)
    try:
        yield
    finally:
        field.default = before
        RolloutConfig.model_rebuild(force=True)


def pytest_configure(config):
    """With ``SGLROLLOUT_GPU_FAST_SYNC`` set to 0 or 1, the whole session runs under
    :func:`fast_sync_default` (False or True), set before any fixture (module-scoped workers included)
    builds a config."""
    value = os.environ.get("SGLROLLOUT_GPU_FAST_SYNC")
    if value in ("0", "1"):
        config._sgl_rollout_fast_sync = contextlib.ExitStack()
        config._sgl_rollout_fast_sync.enter_context(fast_sync_default(value == "1"))
