"""PNG plots of a demo run (matplotlib, no display needed).

* ``reward.png``: mean reward and fraction correct of each step's rollout, and held-out accuracy at
  the evaluated steps, by step;
* ``memory_step.png``: device memory in use after each phase of one training step, which shows the
  staged wake (weights back, sync or adapter load, trainer offloaded, KV cache back);
* ``memory_timeline.png``: device memory in use over the whole run, by wall time.

Memory is the driver's view of the whole device (all processes: the trainer and SGLang's scheduler),
sampled at the end of each phase, in GiB (2**30 bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

GIB = 2**30

#: Phases of the staged wake (``RolloutWorker.update_weights``; ``adapter``: a LoRA adapter's load in
#: ``RolloutWorker.update_adapter``), coloured apart in the plots.
WAKE_PHASES = ("resume_weights", "sync", "adapter", "offload_trainer", "empty_cache", "resume_kv_cache")
#: Phases that end a training step: a weight sync, or a LoRA adapter load.
SYNC_PHASES = ("sync", "adapter")
TRAIN_PHASES = ("load_trainer", "score", "train")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reward(rows: List[dict], path: Path) -> Path:
    """Reward, fraction correct and eval accuracy by step; returns ``path``."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["reward_mean"] for r in rows], marker=".", label="rollout reward (mean)")
    ax.plot(steps, [r["correct_frac"] for r in rows], marker=".", alpha=0.7, label="rollout correct (fraction)")
    ev = [(r["step"], r["eval_acc"]) for r in rows if r.get("eval_acc") is not None]
    if ev:
        ax.plot([s for s, _ in ev], [a for _, a in ev], marker="o", linestyle="--", label="held-out accuracy (greedy)")
    ax.set_xlabel("step (last point: final weights, no training)")
    ax.set_ylabel("reward / accuracy")
    ax.set_title("GRPO on arithmetic word problems")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _phase_colour(phase: str) -> str:
    if phase in WAKE_PHASES:
        return "tab:green"
    if phase in TRAIN_PHASES:
        return "tab:orange"
    if phase == "sleep":
        return "tab:gray"
    return "tab:blue"


def pick_step(timeline: List[dict]) -> Optional[int]:
    """The step shown by :func:`plot_memory_step`: the second training step when there is one
    (the first allocates the trainer's state for the first time), else the first."""
    steps = sorted({r["step"] for r in timeline if r["step"] >= 0 and r["phase"] in SYNC_PHASES})
    if not steps:
        return None
    return steps[1] if len(steps) > 1 else steps[0]


def plot_memory_step(timeline: List[dict], path: Path, step: Optional[int] = None) -> Optional[Path]:
    """Bars of device memory in use after each phase of ``step`` (default :func:`pick_step`).

    Returns ``path``, or None when the timeline has no training step.
    """
    step = pick_step(timeline) if step is None else step
    recs = [r for r in timeline if r["step"] == step]
    if not recs:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    used = [r["used_bytes"] / GIB for r in recs]
    x = range(len(recs))
    ax.bar(x, used, color=[_phase_colour(r["phase"]) for r in recs])
    for i, u in zip(x, used):
        ax.text(i, u, f"{u:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["phase"] for r in recs], rotation=35, ha="right")
    ax.set_ylabel("device memory in use (GiB)")
    ax.set_title(f"one step (step {step}): rollout (blue), sleep (grey), training (orange), staged wake (green)")
    ax.title.set_fontsize(10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory_timeline(timeline: List[dict], path: Path) -> Optional[Path]:
    """Device memory in use over the run (one point per phase); None when the timeline is empty."""
    if not timeline:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.5))
    t = [r["wall_s"] for r in timeline]
    ax.step(t, [r["used_bytes"] / GIB for r in timeline], where="post", color="tab:blue")
    ax.scatter(t, [r["used_bytes"] / GIB for r in timeline], s=6, c=[_phase_colour(r["phase"]) for r in timeline])
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("device memory in use (GiB)")
    ax.set_title("device memory across the run (points coloured by phase as in memory_step.png)")
    ax.title.set_fontsize(10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_all(rows: List[dict], timeline: List[dict], out_dir) -> List[str]:
    """Write every plot into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    written = []
    if rows:
        written.append(plot_reward(rows, out / "reward.png"))
    for p in (plot_memory_step(timeline, out / "memory_step.png"), plot_memory_timeline(timeline, out / "memory_timeline.png")):
        if p is not None:
            written.append(p)
    return [str(p) for p in written]
