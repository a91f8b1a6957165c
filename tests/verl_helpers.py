"""Helpers shared by the tests of ``bench verl`` against verl's own code: the probe's span folder, and
each trainer's verl config composed from a side's command (hydra, verl 0.9.1's yaml files)."""

import gc
import json
import os
import threading
import weakref
from pathlib import Path

import pytest

from sgl_rollout.bench import verl_probe, verl_trainers


def spans_in(folder: Path) -> list:
    """Every span the probe wrote under ``folder`` (all processes' files, in file order)."""
    return [json.loads(line) for f in sorted(folder.glob("spans-*.jsonl")) for line in f.read_text().splitlines()]


@pytest.fixture
def probe_dir(tmp_path, monkeypatch):
    """The probe recording into ``tmp_path/spans`` for one test, uninstalled and its file closed after;
    stall watchers a wrapped call starts in the test are stopped after it (a watcher left running would
    write its stalls into the next test's folder), and the garbage-collection timers it adds are removed."""
    stop = threading.Event()
    gc_callbacks = list(gc.callbacks)
    monkeypatch.setenv(verl_probe.ENV_DIR, str(tmp_path / "spans"))
    monkeypatch.setattr(verl_probe, "_file", None)
    monkeypatch.setattr(verl_probe, "_installed", False)
    monkeypatch.setattr(verl_probe, "_stall_stop", stop)
    monkeypatch.setattr(verl_probe, "_watched_loops", weakref.WeakSet())
    monkeypatch.setattr(verl_probe, "_gil_watch_started", False)
    yield tmp_path / "spans"
    stop.set()
    gc.callbacks[:] = gc_callbacks
    verl_probe.uninstall()  # no listener left behind for the next test
    if verl_probe._file is not None:
        verl_probe._file.close()
    monkeypatch.setattr(verl_probe, "_file", None)


def trainer_config(trainer: str, cmd):
    """verl's config of ``trainer`` composed with the overrides of ``cmd`` (a side's ``python -m ...``
    command, checked to run that trainer's module), without hydra's own node."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    root = os.path.dirname(verl.__file__)
    config_dirs = {"sync": os.path.join(root, "trainer", "config"),
                   "one_step_off": os.path.join(root, "experimental", "one_step_off_policy", "config"),
                   "fully_async": os.path.join(root, "experimental", "fully_async_policy", "config")}
    names = {"sync": "ppo_trainer", "one_step_off": "one_step_off_ppo_trainer",
             "fully_async": "fully_async_ppo_trainer"}
    assert cmd[1:3] == ["-m", verl_trainers.MODULES[trainer]]
    with initialize_config_dir(config_dir=config_dirs[trainer], version_base=None):
        cfg = compose(config_name=names[trainer], overrides=list(cmd[3:]), return_hydra_config=True)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg
