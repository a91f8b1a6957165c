"""Several processes under :mod:`sgl_rollout.integrations.trl` (``accelerate launch``): each rank's engine
settings, the rule by which one rank's failed engine call fails every rank, and one TP engine shared by a group
of ranks (:class:`TPGroupRanks`), as TRL's vLLM colocate mode runs with ``vllm_tensor_parallel_size``
(``trl/generation/vllm_generation.py``).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

__all__ = ["PER_RANK_SERVER_ARGS", "RankFailedError", "TPGroupRanks", "agreed", "rank_rollout_config"]


#: SGLang ``ServerArgs`` fields :func:`rank_rollout_config` sets per rank when several processes run (a
#: value given in ``engine_kwargs`` would be the same on every rank: two engines on one GPU or one port).
PER_RANK_SERVER_ARGS = ("base_gpu_id", "gpu_id_step", "nccl_port", "port", "dist_init_addr")


class RankFailedError(RuntimeError):
    """Another rank's engine call failed in the same generation (several processes): raised on every rank
    whose own call went well, at the same point as the failing rank's own error, so that no rank waits in
    TRL's next collective for one that has stopped. The message names the rank and its error in one line."""


def _tensor_parallel_size(rollout) -> int:
    """The TP size of ``rollout`` (a RolloutConfig, or a worker with a ``config``); 1 when it has none."""
    cfg = getattr(rollout, "config", rollout)
    return int(getattr(cfg, "tensor_model_parallel_size", 1) or 1)


def rank_rollout_config(config, accelerator):
    """This rank's engine settings when several processes run (accelerate's DDP): ``config`` with SGLang's
    ``base_gpu_id`` = the rank's GPU (``accelerator.device.index``, which accelerate sets to
    ``local_process_index % device_count`` in ``PartialState.set_device``, ``accelerate/state.py``; off CUDA,
    as in the CPU tests, ``accelerator.local_process_index``), ``gpu_id_step`` 1, and ``nccl_port`` /
    ``port`` from a port block of its own (:func:`sgl_rollout.engine.layout.replica_layout` with the local
    rank as the replica rank, moved by whole strides of all ranks' blocks past ports in use here; the
    verl path's way to keep engines on one host apart, ``engine/layout.py``). SGLang's other names are
    per engine already (its ZMQ sockets are ``ipc://`` temporary files, ``PortArgs.init_new`` in
    ``sglang/srt/server_args.py``; torch-memory-saver's state is per process). A ``random_seed`` in
    ``engine_kwargs`` gets ``+ accelerator.process_index``, as TRL seeds each colocated vLLM with its rank
    (``trl/generation/vllm_generation.py``): ranks given the same prompts must not draw the same samples.
    Unset, SGLang draws one per engine.

    Args:
        config: a :class:`~sgl_rollout.config.RolloutConfig`, or anything else (a ready worker: returned
            as it is).
        accelerator: the trainer's ``accelerate.Accelerator``.

    With ``tensor_model_parallel_size`` T > 1 the ranks form groups of T (:class:`TPGroupRanks`): the group's
    first rank gets the settings above for an engine over its GPU and the next T - 1 (one port block per
    group), the others None (no engine of their own).

    Returns:
        ``config`` itself with one process; else a copy with the engine kwargs above, or None for a TP
        group's member.

    Raises:
        LayoutError: no free port block below :data:`sgl_rollout.engine.layout.MAX_PORT`.
    """
    from ..config import RolloutConfig
    from ..engine.layout import port_is_free, replica_layout

    if not isinstance(config, RolloutConfig) or accelerator.num_processes == 1:
        return config
    tp, local = _tensor_parallel_size(config), accelerator.local_process_index
    if local % tp:  # a member of a TP group (TPGroupRanks): the group's leader runs its engine
        return None
    device = accelerator.device
    gpu = device.index if device.type == "cuda" and device.index is not None else local
    layout = replica_layout(local // tp, tp, [[gpu + i for i in range(tp)]],
                            n_replicas=accelerator.num_processes // tp).first_free_block(port_is_free)
    kwargs = dict(config.engine_kwargs, base_gpu_id=int(gpu), gpu_id_step=1, nccl_port=layout.nccl_port,
                  port=layout.sglang_port)
    if kwargs.get("random_seed") is not None:
        kwargs["random_seed"] = int(kwargs["random_seed"]) + accelerator.process_index
    return config.model_copy(update={"engine_kwargs": kwargs})


def _one_line(err: BaseException, limit: int = 400) -> str:
    """``"<type>: <message>"`` on one line, at most ``limit`` characters."""
    text = " ".join(f"{type(err).__name__}: {err}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def agreed(call, accelerator):
    """Run ``call()`` on every rank, then make every rank fail when any did.

    Each rank must reach this point the same number of times, in the same order as TRL's collectives:
    the failing rank re-raises its own error, the others raise :class:`RankFailedError` naming it. With
    one process nothing is exchanged. One ``gather_object`` of a short string or None per call
    (accelerate's ``all_gather_object``).

    Returns:
        what ``call()`` returned.

    Raises:
        whatever ``call()`` raised, on its rank; RankFailedError on the other ranks.
    """
    error: Optional[Exception] = None
    out = None
    try:
        out = call()
    except Exception as err:  # noqa: BLE001 - reported to every rank, then raised again below
        error = err
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        lines = gather_object([None if error is None else _one_line(error)])
        failed = [(rank, line) for rank, line in enumerate(lines) if line is not None]
        if failed and error is None:
            rank, line = failed[0]
            raise RankFailedError(f"rank {rank} of {accelerator.num_processes} failed in its generation "
                                  f"({line}); rank {accelerator.process_index} stops with it")
    if error is not None:
        raise error
    return out


class TPGroupRanks:
    """``size`` consecutive ranks sharing one TP engine, as TRL's vLLM colocate mode groups ranks for
    ``vllm_tensor_parallel_size`` (consecutive ranks, ``trl/generation/vllm_generation.py``): the group's first
    rank (the leader) runs the engine over its GPU and the next ``size - 1`` (:func:`rank_rollout_config`) and
    generates every member's prompts; the members run none. Under DDP every rank holds the whole model, so
    the leader's replica is the group's weights.

    Args:
        accelerator: the trainer's ``accelerate.Accelerator``; ``num_processes`` a multiple of ``size``.
        size: the engine's TP size (> 1).
    """

    def __init__(self, accelerator, size: int):
        self.accelerator, self.size = accelerator, int(size)
        self.rank = accelerator.process_index
        self.first, self.index = self.rank - self.rank % self.size, self.rank % self.size
        self.leader = self.index == 0

    def generate(self, call: Callable, prompt_ids, images) -> Tuple[List[List[int]], List[List[float]]]:
        """``call(prompt ids, images)`` -> ``(completion ids, logprobs)`` once for the whole group, on the
        leader, with every member's prompts (and images) in rank order, as TRL's colocate mode gathers them in
        its TP group; each rank gets back its own prompts' answers. Two ``gather_object`` calls over all ranks
        (accelerate's), made by every rank whatever happens, so a failing leader stops its members at the same
        point instead of leaving them in a collective.

        Raises:
            whatever ``call`` raised, on the leader; :class:`RankFailedError` on its members.
        """
        from accelerate.utils import gather_object

        mine = ([list(p) for p in prompt_ids], None if images is None else list(images))
        every = gather_object([mine])[self.first:self.first + self.size]
        answer, error = None, None
        if self.leader:
            try:
                answer = self._split(every, *call(*self._joined(every)))
            except Exception as err:  # noqa: BLE001 - told to the members, then raised again below
                error, answer = err, _one_line(err)
        lead = gather_object([answer])[self.first]
        if error is not None:
            raise error
        if isinstance(lead, str):
            raise RankFailedError(f"rank {self.first}, the leader of this rank's TP engine, failed in its "
                                  f"generation ({lead}); rank {self.rank} stops with it")
        return lead[self.index]

    @staticmethod
    def _joined(every):
        """Every member's prompts in rank order, and their images (None when no prompt has any)."""
        ids = [p for member, _ in every for p in member]
        if not any(imgs is not None and any(imgs) for _, imgs in every):
            return ids, None
        return ids, [x for member, imgs in every for x in (imgs if imgs is not None else [None] * len(member))]

    @staticmethod
    def _split(every, completions, logprobs):
        """``(completions, logprobs)`` of the joined prompts cut back into one pair per member."""
        out, at = [], 0
        for member, _ in every:
            out.append((completions[at:at + len(member)], logprobs[at:at + len(member)]))
            at += len(member)
        return out
