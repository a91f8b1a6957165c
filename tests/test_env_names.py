"""This package's environment variables are ``SGLROLLOUT_*``, not ``SGL_ROLLOUT_*``: SGLang 0.5.12 copies every
``SGL_*`` variable to ``SGLANG_*`` and warns in every process that imports it (0.5.10.post1 too) ("Environment variable
SGL_ROLLOUT_PROBE_DIR is deprecated, please use SGLANG_ROLLOUT_PROBE_DIR", seen in every Ray worker of a
``bench verl`` run on 2026-11-28), advice that would silently turn the setting off."""

import re
from pathlib import Path

import pytest

from sgl_rollout.engine.sglang_version import TESTED

from test_sglang_versions import _tree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV_NAME = re.compile(r"""["'`$](SGL_[A-Z][A-Z0-9_]*)""")
#: SGLang's own variables this package sets or names (its old spelling of the imbalance check, read by 0.5.10).
#: Python names, not variables (``verl_config.SGL_ROLLOUT_KWARGS``), and the old prefix the package warns about.
SGLANGS_OWN = {"SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK", "SGL_ROLLOUT_KWARGS", "SGL_ROLLOUT_"}


def test_no_variable_of_this_package_is_in_sglangs_deprecated_namespace():
    found = {}
    for path in list((ROOT / "sgl_rollout").rglob("*.py")) + [ROOT / "README.md"] + list((ROOT / "docs").glob("*.md")):
        for name in ENV_NAME.findall(path.read_text()):
            if name not in SGLANGS_OWN:
                found.setdefault(name, path.relative_to(ROOT).as_posix())
    assert found == {}


@pytest.mark.parametrize("version", sorted(TESTED))
def test_each_release_renames_sgl_variables(version):
    environ = (_tree(version) / "sglang" / "srt" / "environ.py").read_text()
    assert 'key.startswith("SGL_")' in environ and 'key.replace("SGL_", "SGLANG_", 1)' in environ


def test_a_variable_of_the_old_spelling_is_named_in_a_warning():
    import os
    import subprocess
    import sys

    env = dict(os.environ, SGL_ROLLOUT_LAYERED_GATHER="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-W", "always", "-c", "import sgl_rollout"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SGL_ROLLOUT_LAYERED_GATHER not read" in proc.stderr and "set SGLROLLOUT_LAYERED_GATHER" in proc.stderr
    env.pop("SGL_ROLLOUT_LAYERED_GATHER")
    proc = subprocess.run([sys.executable, "-W", "always", "-c", "import sgl_rollout"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert "not read" not in proc.stderr
