"""Version-gated fixes to SGLang or verl behaviour, one module each.

This folder sits at the repository's top level and is installed as ``sgl_rollout.patches``
(``pyproject.toml``, ``[tool.setuptools.package-dir]``). Each module names the upstream file it
targets and the versions it applies to, and has a test that runs against that upstream module.
"""
