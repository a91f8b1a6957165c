"""The installed package holds every module of the source tree.

``pyproject.toml`` lists its packages by hand (``patches/`` is mapped to ``sgl_rollout.patches``), so a new
sub-package that is not added there is missing from ``pip install .`` while every test run from the checkout
still imports it. Seen on 2 H100s: verl's Ray workers, which import the installed copy, failed with
``ModuleNotFoundError: No module named 'sgl_rollout.engine'``. This builds the wheel as pip does and compares.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from sgl_rollout.bench.verl_compare import package_files

ROOT = Path(__file__).resolve().parent.parent


def _source_modules() -> set:
    """Wheel paths the source tree should produce: ``sgl_rollout/**.py`` and ``patches/*.py`` as
    ``sgl_rollout/patches/`` (the installed layout, as the bench's stale-copy check lists it)."""
    return {"sgl_rollout/" + rel for rel in package_files(ROOT / "sgl_rollout")}


def test_wheel_holds_every_source_module(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("sgl_rollout", "patches"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("sgl_rollout-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_modules() - names)
    assert not missing, f"not in the wheel (add their package to pyproject.toml's [tool.setuptools] packages): {missing}"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "sgl_rollout = sgl_rollout.integrations.verl:register" in text  # what verl's rollout.name=sglang finds
