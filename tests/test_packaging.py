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

import pytest

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
    # the product's only verl plugin: the benchmark's timing probe reaches verl's workers through Ray's
    # worker_process_setup_hook (sgl_rollout.bench.verl_probe), not through every user's `import verl`;
    # the only SGLang plugins: the Qwen-VL fixes SGLang's scheduler loads (vision rope, weight names)
    assert {ln for ln in text.splitlines() if "=" in ln} == {
        "sgl_rollout = sgl_rollout.integrations.verl:register", "sgl-rollout = sgl_rollout.__main__:main",
        "sgl_rollout_qwen2_5_vl_vision_rope = sgl_rollout.patches.qwen2_5_vl_vision_rope:apply",
        "sgl_rollout_qwen_vl_weight_names = sgl_rollout.patches.qwen_vl_weight_names:apply"}
    assert "[sglang.srt.plugins]" in text


def _imported_modules(path: Path, package: str) -> set:
    """Absolute names of the modules ``path`` (a module of ``package``) imports, anywhere in it (function
    bodies included): ``from ..bench import x`` in ``sgl_rollout.demo.loop`` is ``sgl_rollout.bench`` and
    ``sgl_rollout.bench.x``."""
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    parts = package.split(".")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = parts[: len(parts) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


@pytest.mark.parametrize("package,forbidden", [
    ("sgl_rollout.demo", "sgl_rollout.bench"),
    ("sgl_rollout.bench", "sgl_rollout.demo"),
])
def test_the_demo_and_the_benchmarks_do_not_import_each_other(package, forbidden):
    """What both use (the model, the task, verl's run of it) lives below both, in sgl_rollout.workloads."""
    folder = ROOT / package.replace(".", "/")
    bad = sorted(f"{p.relative_to(ROOT)}: {m}" for p in folder.glob("*.py")
                 for m in _imported_modules(p, package) if m == forbidden or m.startswith(forbidden + "."))
    assert bad == []


@pytest.mark.parametrize("module", ["sgl_rollout/workloads.py", "sgl_rollout/trace.py"])
def test_the_shared_modules_stay_below_the_demo_and_the_benchmarks(module):
    imported = _imported_modules(ROOT / module, "sgl_rollout")
    assert sorted(m for m in imported if m.startswith(("sgl_rollout.demo", "sgl_rollout.bench"))) == []
    if module.endswith("trace.py"):  # imported by the engine's hot paths: the standard library only
        assert sorted(m for m in imported if m.split(".")[0] in ("sgl_rollout", "torch", "ray", "verl", "sglang")) == []


def test_the_import_check_sees_relative_and_nested_imports(tmp_path):
    """The check above can fail: a function-level ``from ..bench import`` in the demo is found."""
    mod = tmp_path / "loop.py"
    mod.write_text("def run():\n    from ..bench import gpu_engine_flags\n    from . import task\n")
    assert {"sgl_rollout.bench", "sgl_rollout.bench.gpu_engine_flags", "sgl_rollout.demo.task"} <= \
        _imported_modules(mod, "sgl_rollout.demo")


def _imports_between_modules():
    """``{module: modules of this package it imports}``, lazy (function-level) imports included, read from
    the source (``from . import x`` counts as the module ``x`` where ``x`` is one, else as the package)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = {}
    for f in (root / "sgl_rollout").rglob("*.py"):
        parts = f.relative_to(root).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {m: set() for m in files}
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.level or (node.module or "").startswith("sgl_rollout")):
                continue
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in files]
            graph[mod] |= {t for t in (subs if len(subs) == len(node.names) else [target, *subs])
                           if t in files and t != mod}
    return graph


def test_no_module_imports_itself_through_others():
    """No import circle, lazy imports included (issue 46: bench.verl_compare and bench.verl_probe imported
    each other): each module's imports can be read without coming back to it."""
    graph = _imports_between_modules()
    circles = []
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            m = todo.pop()
            if m == start:
                circles.append(start)
                break
            if m not in seen:
                seen.add(m)
                todo.extend(graph[m])
    assert circles == []
