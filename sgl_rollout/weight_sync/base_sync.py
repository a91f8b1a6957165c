"""The base-resend rule of LoRA serving: when the base weights must travel before an adapter.

It lives here and only here (:func:`needs_base_sync`): base weights are sent when the engine does not have
them, never otherwise. verl's merged change "avoid redundant base weight sync when the engine doesn't
sleep" measured up to 26 % faster training from this alone; verl 0.9.1 serves a LoRA policy as an adapter
over base weights the engine keeps (sleep level 1), sends the base once and the adapter every step
(``verl/workers/engine_workers.py``, ``update_weights``). What a sleep releases is the switch's rule
(:func:`sgl_rollout.switch.sleep_releases`).
"""

from __future__ import annotations

from typing import Optional

from ..memory import WEIGHTS
from ..switch import sleep_releases

def is_dummy_load(load_format: Optional[str]) -> bool:
    """True for a load format that gives random weights (``"dummy"``; verl tests ``"dummy" in``)."""
    return "dummy" in str(load_format or "").lower()


def needs_base_sync(*, free_cache_engine: bool, sleep_level: int, base_sync_done: bool, load_format: str,
                    weights_cpu_backup: bool = False, weights_released: Optional[bool] = None) -> bool:
    """Whether the base weights must be sent before an adapter: True exactly when the engine lacks them.

    The engine lacks its base weights when

    1. it never had them: ``load_format`` is a dummy format (random weights) and no base sync reached
       it since it started (``base_sync_done`` False): the first sync after a dummy load; or
    2. it lost them: its ``weights`` tag was released since the last base sync (or since the start)
       and no CPU backup restores them. ``weights_released`` says whether that happened, when it is
       known (an engine's own record); None predicts it from the settings: the weights tag is released
       on every sleep when ``free_cache_engine`` is True and ``sleep_level`` is 2, never otherwise.

    So the base is never resent when ``free_cache_engine`` is False (nothing is ever released) or the
    weights tag stayed resident (sleep level 1, verl's adapter mode); with a non-dummy load it is never
    sent at all unless released. The table, for ``weights_cpu_backup=False`` and
    ``weights_released=None`` (D: dummy load format, "-": either):

    ===================  ===========  ==============  ======  ======
    free_cache_engine    sleep_level  base_sync_done  format  result
    ===================  ===========  ==============  ======  ======
    -                    -            False           D       True
    True                 2            -               -       True
    any other row                                             False
    ===================  ===========  ==============  ======  ======

    Args:
        free_cache_engine: sleep releases memory at all (verl's ``rollout.free_cache_engine``).
        sleep_level: 1 releases the KV cache only, 2 also the weights.
        base_sync_done: a complete base-weight sync reached the engine since it started.
        load_format: the engine's load format (``"dummy"``, ``"auto"``, ``"safetensors"``, ...).
        weights_cpu_backup: SGLang's ``enable_weights_cpu_backup``: released weights come back as they were.
        weights_released: observed: the weights tag was released since the last base sync (or the
            start). None: predicted from ``free_cache_engine`` and ``sleep_level``.

    Returns:
        True when base weights must be sent.

    Raises:
        ValueError: ``sleep_level`` not 1 or 2.
    """
    predicted = sleep_releases(WEIGHTS, free_cache_engine, sleep_level)  # the switch's rule (validates the level)
    if is_dummy_load(load_format) and not base_sync_done:
        return True
    released = predicted if weights_released is None else bool(weights_released)
    return released and not weights_cpu_backup


def engine_needs_base_sync(engine) -> bool:
    """:func:`needs_base_sync` for a :class:`~sgl_rollout.engine.RolloutEngine` from what it observed:
    whether a complete weight sync reached it since it (re)started, and whether its weights tag was
    released since then."""
    cfg = engine.config
    return needs_base_sync(free_cache_engine=cfg.free_cache_engine, sleep_level=cfg.sleep_level,
                           base_sync_done=engine.weights_synced, load_format=cfg.load_format,
                           weights_cpu_backup=cfg.enable_weights_cpu_backup,
                           weights_released=engine.weights_released_since_sync)


class BaseWeightsMissing(RuntimeError):
    """The engine lacks its base weights (dummy load, level-2 release, restart) and no base weights were
    given: loading an adapter now would serve it over garbage. Nothing was sent."""


__all__ = ["BaseWeightsMissing", "engine_needs_base_sync", "is_dummy_load", "needs_base_sync"]
