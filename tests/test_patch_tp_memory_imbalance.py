"""The imbalance-check switch, checked against the real sglang.srt.environ of the installed SGLang."""

import json
import os
import subprocess
import sys

import pytest

from sgl_rollout.patches import tp_memory_imbalance as patch

PROBE = (
    "import json, warnings; warnings.simplefilter('ignore');"
    "from sglang.srt.environ import envs;"
    "print(json.dumps(envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get()))"
)


def _check_enabled(env):
    """Whether SGLang's model runner would run the check, per the real environ module in a fresh process."""
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _clean_env():
    env = dict(os.environ)
    env.pop(patch.LEGACY_VAR, None)
    env.pop(patch.NEW_VAR, None)
    return env


def test_installed_version_is_new_style():
    from packaging.version import Version

    assert Version(patch.installed_sglang_version()) >= patch.FIRST_NEW_STYLE


def test_default_is_on():
    assert _check_enabled(_clean_env()) is True


def test_commonly_documented_legacy_switch_turns_the_check_on():
    env = _clean_env()
    env[patch.LEGACY_VAR] = "true"
    env[patch.NEW_VAR] = "0"  # even an explicit new-style off is overwritten by the legacy value
    assert _check_enabled(env) is True


def test_patch_turns_the_check_off_even_with_legacy_var_set():
    env = _clean_env()
    env[patch.LEGACY_VAR] = "true"
    updates = patch.apply(env)
    assert updates == {patch.NEW_VAR: "0", patch.LEGACY_VAR: None}
    assert patch.LEGACY_VAR not in env
    assert _check_enabled(env) is False


@pytest.mark.parametrize(
    "version,expected",
    [
        ("0.5.6", {patch.LEGACY_VAR: "true"}),
        ("0.4.10.post2", {patch.LEGACY_VAR: "true"}),
        ("0.5.7", {patch.NEW_VAR: "0", patch.LEGACY_VAR: None}),
        ("0.5.7rc1", {patch.NEW_VAR: "0", patch.LEGACY_VAR: None}),
        ("0.5.10.post1", {patch.NEW_VAR: "0", patch.LEGACY_VAR: None}),
        ("0.6.0", {patch.NEW_VAR: "0", patch.LEGACY_VAR: None}),
    ],
)
def test_version_gate(version, expected):
    assert patch.env_updates(version) == expected
