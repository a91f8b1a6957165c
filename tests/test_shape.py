"""The shape of the package (issue 37): no class over 400 lines, no function over 80, and the house's floors.

Floors, from the bottom: ``config``, ``errors``, ``memory``, ``twin``, ``lora_adapter``, ``trace`` ->
``engine`` -> ``switch`` -> ``weight_sync`` -> ``worker`` / ``server`` -> ``integrations`` -> ``doctor``,
``workloads`` (the models and tasks ``demo`` and ``bench`` share). Nothing imports a floor above its own;
``demo`` and ``bench`` sit beside each other on top and import neither the other.
"""

import ast
import pathlib

import pytest

PKG = pathlib.Path(__import__("os").environ.get("SHAPE_ROOT") or pathlib.Path(__file__).resolve().parent.parent) / "sgl_rollout"
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80


def _modules():
    return sorted(p for p in PKG.rglob("*.py"))


def _sizes(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.end_lineno - node.lineno + 1


def test_no_class_over_400_lines_and_no_function_over_80():
    too_big = []
    for path in _modules():
        for node, n in _sizes(path):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if n > limit:
                too_big.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines > {limit})")
    assert not too_big, "\n".join(too_big)


def _imports(path):
    """Absolute names of the sgl_rollout modules ``path`` imports (relative imports resolved)."""
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    package = parts if path.name == "__init__.py" else parts[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("sgl_rollout"))
    return out


#: floor of each top-level part (a module may import its own floor and those below)
FLOORS = {
    "sgl_rollout": 0, "sgl_rollout.config": 0, "sgl_rollout.errors": 0, "sgl_rollout.memory": 0,
    "sgl_rollout.twin": 0, "sgl_rollout.lora_adapter": 0, "sgl_rollout.trace": 0, "sgl_rollout.patches": 0,
    "sgl_rollout.checkpoint_names": 0,
    "sgl_rollout.engine": 1, "sgl_rollout.switch": 2, "sgl_rollout.weight_sync": 3,
    "sgl_rollout.worker": 4, "sgl_rollout.server": 4, "sgl_rollout.integrations": 5,
    "sgl_rollout.doctor": 6, "sgl_rollout.__main__": 6, "sgl_rollout.workloads": 6,
}


def _floor(module):
    parts = module.split(".")
    for k in range(len(parts), 0, -1):
        name = ".".join(parts[:k])
        if name in FLOORS and (k > 1 or len(parts) == 1):
            return FLOORS[name]
    return None


def test_no_arrow_back_up():
    wrong = []
    for path in _modules():
        me = ".".join(path.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        mine = _floor(me)
        if mine is None:
            continue
        for dep in _imports(path):
            theirs = _floor(dep)
            if theirs is not None and theirs > mine:
                wrong.append(f"{me} (floor {mine}) imports {dep} (floor {theirs})")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize("a,b", [("demo", "bench"), ("bench", "demo")])
def test_demo_and_bench_do_not_import_each_other(a, b):
    wrong = [f"{p.name} imports {d}" for p in (PKG / a).rglob("*.py") for d in _imports(p)
             if d.startswith(f"sgl_rollout.{b}")]
    assert not wrong, wrong


def test_every_part_has_a_floor():
    """A new top-level module must be placed on a floor (else the arrow test would not see it)."""
    missing = [p.name for p in PKG.iterdir()
               if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())]
    missing = [m for m in missing if m not in ("demo", "bench") and _floor("sgl_rollout." + m.removesuffix(".py")) is None]
    assert not missing, missing
