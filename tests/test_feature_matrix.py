"""The README's feature matrix (issue 38 item 5) is :func:`verl_features.markdown`, and every row holds:
a served feature names a test that exists, and a refused one is refused at start-up by
``check_verl_features`` with one line naming its key and what to use instead."""

import ast
from pathlib import Path

import pytest

from sgl_rollout.integrations import verl_features
from sgl_rollout.integrations.verl_config import ROLLOUT_PREFIX, UnsupportedVerlFeature, check_verl_features

ROOT = Path(__file__).resolve().parent.parent


def _test_exists(node: str) -> bool:
    path, name = node.split("::")
    file = ROOT / path
    if not file.is_file():
        return False
    return any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
               for n in ast.walk(ast.parse(file.read_text())))


@pytest.mark.parametrize("feature", verl_features.FEATURES, ids=lambda f: f.name[:40])
def test_each_row_names_a_test_that_exists(feature):
    assert _test_exists(feature.test), feature.test


def test_each_refused_feature_is_refused_at_start_up():
    refused = [f for f in verl_features.FEATURES if f.refused_by]
    assert len(refused) >= 6
    for f in refused:
        cfg, key = f.refused_by
        assert not f.ours
        with pytest.raises(UnsupportedVerlFeature) as e:
            check_verl_features(cfg)
        lines = str(e.value).splitlines()[1:]
        assert len(lines) == 1, lines  # one line, for this feature alone
        assert lines[0].strip().startswith(f"{ROLLOUT_PREFIX}.{key}=") and "; use " in lines[0], lines[0]
    check_verl_features({})  # the defaults are served


def test_every_refused_row_says_how_it_is_refused():
    for f in verl_features.FEATURES:
        if not f.ours:
            assert f.refused_by or "refused" in f.note, f.name


def test_the_readme_holds_the_matrix():
    assert verl_features.markdown() in (ROOT / "README.md").read_text()
