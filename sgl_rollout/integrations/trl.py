"""TRL's ``GRPOTrainer`` generating on SGLang through this package, colocated: :class:`SglGRPOTrainer`.

A TRL user changes one line of a GRPO script, the trainer class, and passes the engine's settings::

    from sgl_rollout.config import RolloutConfig
    from sgl_rollout.integrations.trl import SglGRPOTrainer

    trainer = SglGRPOTrainer(model=model_id, reward_funcs=reward, args=GRPOConfig(...), train_dataset=ds,
                             rollout=RolloutConfig(model_path=model_id, gpu_memory_utilization=0.3))

Why a subclass of ``_generate_single_turn`` and not TRL's ``rollout_func``: in TRL 1.16
(``trl/trainer/grpo_trainer.py``) ``rollout_func`` is marked experimental, takes the prompts as text and
skips TRL's own chat templating and tool loop, and its weight-sync guard is tied to ``use_vllm``.
``_generate_single_turn(prompt_ids, images, multimodal_fields, num_generations)`` is the narrowest seam:
token ids in, completion ids and logprobs out; TRL's templating, tool-call loop (which calls it again for
each tool turn) and reward path stay TRL's. It is the method TRL's vLLM colocate mode fills
(``vllm_generation.generate``); this class fills it the same way:

* before the first generation of each training step (``state.global_step`` changed, as TRL's
  ``_last_loaded_step`` guard does), the staged wake with a weight sync
  (:meth:`sgl_rollout.worker.RolloutWorker.update_weights`: weights resumed, the trainer's parameters
  checked against the weight manifest and sent, the KV cache resumed);
* the completions from the engine, one per prompt (TRL's sampler has repeated each prompt
  ``num_generations`` times already), with their logprobs;
* after the generation of the step, the engine sleeps (:meth:`~sgl_rollout.worker.RolloutWorker.sleep`,
  by ``sleep_level``), so training gets the memory back.

Several processes (``accelerate launch --num_processes 2``, plain DDP) run data parallel as TRL's vLLM
colocate mode does with ``vllm_tensor_parallel_size=1`` (``trl/generation/vllm_generation.py``,
``VLLMGeneration.generate``: "each device holds vLLM copy and work on their own batch of prompts"):

* each rank starts its own engine on its own GPU (:func:`rank_rollout_config`: SGLang's ``base_gpu_id`` =
  the rank's ``accelerator.device``, a port block of its own from :mod:`sgl_rollout.engine.layout`);
* each rank generates only for the prompts its dataloader gave it: TRL's ``RepeatSampler`` repeats each
  prompt ``num_generations`` times and accelerate hands each rank its own consecutive slice of the
  generation batch, so a prompt's group may span ranks; TRL gathers the rewards of all ranks before it
  computes the group advantages and slices its own back (``_generate_and_score_completions``,
  ``trl/trainer/grpo_trainer.py``). Nothing here gathers prompts;
* each rank syncs its engine from its own replica of the model (DDP: every rank holds all of it, equal
  after every optimizer step);
* an engine call that fails on one rank fails every rank at the same point, before TRL's next
  collective (:class:`RankFailedError` on the others), instead of leaving them waiting in it.

With ``tensor_model_parallel_size`` T > 1 over several processes, as TRL's ``vllm_tensor_parallel_size=T``,
each T consecutive ranks share one TP engine, started by the first of them over its GPU and the next T - 1;
it generates all their prompts, gathered, and each rank gets its own answers back
(:class:`~.trl_ranks.TPGroupRanks`).

Also served: a PEFT model (TRL's ``peft_config``) syncs its merged weights, as TRL's vLLM colocate mode does,
computed out of place (:mod:`.trl_peft`); TRL's tool-call loop (``tools=[...]``) calls the same seam, the
engine stays awake through it and sleeps once after; images (a vision-language model such as Qwen2.5-VL)
reach the engine with their prompts.

``GRPOConfig.generation_kwargs`` and ``vllm_structured_outputs_regex`` apply as in TRL's vLLM colocate mode,
in vLLM's names or SGLang's (:mod:`.trl_sampling`); a key SGLang has no equal for is refused at start-up.

Not yet served (each refused in one line, at start-up or at the call): TRL's ``use_vllm``, models under
DeepSpeed ZeRO-3 or FSDP (their parameters must be gathered first), LoRA variants such as DoRA, tools with TP
groups (their ranks run the tool loop a different number of times).

Ran on the CPU with an engine double (``tests/test_trl.py``, ``test_trl_tools.py``, ``test_trl_peft.py``;
``tests/test_trl_dp.py``: 2 processes over gloo, data parallel and one TP group); on GPUs
``tests/gpu/test_trl_gpu.py``: 1 GPU passed on an H200 (again at c3b72dc); the data-parallel 2-GPU case failed
its first try (its log was lost), the image case's engine died on FA3 vision attention the GPU host lacks (now
on SDPA); those, TP=2 over 2 ranks, the LoRA case and the tool loop (a regex-forced tool call) are not yet run
(docs/gpu-tests.md).
"""

from __future__ import annotations

import logging
from typing import List, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from .trl_peft import _lora_variant, merged_adapter_weights, policy_weights
from .trl_ranks import (PER_RANK_SERVER_ARGS, RankFailedError, TPGroupRanks, _tensor_parallel_size, agreed,
                        rank_rollout_config)
from .trl_sampling import STRUCTURED_TO_SGLANG, sampling_params_of

logger = logging.getLogger(__name__)

#: The TRL releases this integration was written and tested against (pyproject.toml's ``trl`` extra).
TRL_REQUIREMENT = ">=1.16,<1.17"
SUPPORTED_TRL = SpecifierSet(TRL_REQUIREMENT)


class UnsupportedTRLVersion(RuntimeError):
    """The installed TRL is outside :data:`SUPPORTED_TRL`; raised before the trainer is built."""


def check_trl_version(version: Optional[str] = None) -> str:
    """Refuse a TRL outside :data:`SUPPORTED_TRL` in one line.

    Args:
        version: the version to check; None: the installed one.

    Returns:
        the version checked.

    Raises:
        UnsupportedTRLVersion: outside the range, not a version, or TRL not installed.
    """
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed

        try:
            version = installed("trl")
        except PackageNotFoundError:
            raise UnsupportedTRLVersion(
                f"TRL is not installed: pip install 'sgl-rollout[trl]' (trl{TRL_REQUIREMENT})") from None
    try:
        inside = Version(version) in SUPPORTED_TRL
    except InvalidVersion:
        inside = False
    if not inside:
        raise UnsupportedTRLVersion(f"trl {version} is outside the range sgl-rollout's TRL trainer supports "
                                    f"(trl{TRL_REQUIREMENT}): pip install 'sgl-rollout[trl]'")
    return version


def _trainer_base():
    from trl import GRPOTrainer

    return GRPOTrainer


def _refusal(args, model) -> Optional[str]:
    """Why this trainer cannot serve ``args`` / ``model`` yet (None: it can)."""
    if getattr(args, "use_vllm", False):
        return "use_vllm=True: SglGRPOTrainer generates on SGLang; leave use_vllm False"
    return None


def _refusal_after_init(trainer, rollout=None) -> Optional[str]:
    """Why a built trainer cannot be served yet (None: it can): sharded parameters, a LoRA variant (DoRA, ...),
    TP groups that do not divide the processes or with tools, per-rank SGLang settings given once for all
    ranks (:data:`PER_RANK_SERVER_ARGS`), or ``generation_kwargs`` SGLang cannot take
    (:func:`~.trl_sampling.sampling_params_of`; a ``seed`` needs ``enable_deterministic_inference``, a grammar
    needs the engine's tokenizer and a grammar backend)."""
    from ..config import RolloutConfig

    try:
        params = sampling_params_of(trainer)
    except ValueError as e:
        return str(e)
    config = rollout if isinstance(rollout, RolloutConfig) else getattr(rollout, "config", None)
    engine_kwargs = getattr(config, "engine_kwargs", None) or {}
    if "sampling_seed" in params and not engine_kwargs.get("enable_deterministic_inference"):
        return ("generation_kwargs sets a seed, which SGLang applies only with enable_deterministic_inference "
                "(sglang/srt/sampling/sampling_batch_info.py): add engine_kwargs={'enable_deterministic_inference': "
                "True} to the RolloutConfig, or leave the seed out")
    grammar = next((k for k in STRUCTURED_TO_SGLANG.values() if params.get(k) is not None), None)
    if grammar and (engine_kwargs.get("skip_tokenizer_init") or engine_kwargs.get("grammar_backend") == "none"):
        return (f"generation_kwargs sets a {grammar} grammar, which SGLang's scheduler compiles only with its "
                "tokenizer and a grammar backend (GrammarManager, sglang/srt/constrained/grammar_manager.py): leave "
                "skip_tokenizer_init and grammar_backend='none' out of the RolloutConfig's engine_kwargs")
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return "DeepSpeed or FSDP: SglGRPOTrainer gathers no sharded parameters yet"
    model = getattr(trainer, "model", None)
    variant = next(filter(None, map(_lora_variant, model.modules() if hasattr(model, "modules") else ())), None)
    if variant:
        return f"LoRA variant {variant} (DoRA and the like): SglGRPOTrainer merges plain LoRA adapters only"
    procs, tp = trainer.accelerator.num_processes, _tensor_parallel_size(rollout)
    if procs > 1 and tp > 1 and procs % tp:
        return (f"tensor_model_parallel_size={tp} with {procs} processes: the ranks share TP engines in groups "
                f"of {tp} (TRL's vllm_tensor_parallel_size), so the processes must be a multiple of it")
    if procs > 1 and tp > 1 and getattr(trainer, "tools", None):
        return (f"tools with tensor_model_parallel_size={tp} over {procs} processes: a TP group's ranks run TRL's "
                "tool loop a different number of times; use tensor_model_parallel_size=1 (an engine per rank)")
    given = sorted(k for k in PER_RANK_SERVER_ARGS if isinstance(rollout, RolloutConfig) and k in rollout.engine_kwargs)
    if procs > 1 and given:
        return (f"engine_kwargs {given} with {procs} processes: SglGRPOTrainer chooses these per rank (the rank's "
                "GPU, a port block of its own; no multi-node engine); leave them out")
    return None


class _SglGeneration:
    """The generation side of :class:`SglGRPOTrainer` (its ``sgl``): the worker, made on first use from a
    :class:`~sgl_rollout.config.RolloutConfig` (this rank's, :func:`rank_rollout_config`), whether the
    engine is awake, the training step whose weights it holds, and whether TRL's tool loop is running."""

    def __init__(self, rollout, group: Optional[TPGroupRanks] = None):
        self.group, self.engine_here = group, group is None or group.leader
        self._rollout = rollout if self.engine_here else None  # a TP group's member: the leader's engine serves it
        self.synced_step, self.awake, self.in_tool_loop = None, False, False

    @classmethod
    def of(cls, rollout, accelerator) -> "_SglGeneration":
        """This rank's generation side: its engine settings (:func:`rank_rollout_config`) and, with a TP size
        above 1 over several processes, its TP group (:class:`~.trl_ranks.TPGroupRanks`)."""
        tp = _tensor_parallel_size(rollout)
        group = TPGroupRanks(accelerator, tp) if tp > 1 and accelerator.num_processes > 1 else None
        return cls(rank_rollout_config(rollout, accelerator), group)

    @property
    def worker(self):
        from ..config import RolloutConfig
        from ..worker import RolloutWorker

        if isinstance(self._rollout, RolloutConfig):
            self._rollout = RolloutWorker(self._rollout)
        return self._rollout

    def shutdown(self) -> None:
        """Shut this rank's engine down if it runs: nothing when the worker was never made (a
        ``RolloutConfig`` not used yet, a TP group's member) or has no ``shutdown`` (a double)."""
        from ..config import RolloutConfig

        stop = None if isinstance(self._rollout, RolloutConfig) else getattr(self._rollout, "shutdown", None)
        if stop is not None:
            stop()

    def wake(self, step: int, weights) -> None:
        """Make the engine ready to generate with step ``step``'s weights: the staged wake with a weight
        sync (``weights()``: the trainer's ``(name, tensor)`` pairs) when the step changed or the engine
        sleeps (a sleep may have released the weights; a sync is always right, a wake without one is not
        at sleep level 2). Nothing on a TP group's member (its leader syncs the engine)."""
        if not self.engine_here or (self.awake and self.synced_step == step):
            return
        self.worker.update_weights(weights())
        self.synced_step, self.awake = step, True

    def generate(self, trainer, prompt_ids, images=None) -> Tuple[List[List[int]], List[List[float]]]:
        """The wake with ``trainer``'s weights, then one completion per prompt of ``prompt_ids``
        (``List[List[int]]``); ``(completion ids, logprobs)``, both ``List[List]``, in prompt order.

        ``images``: TRL's, None or one entry per prompt, None or that prompt's ``PIL.Image``s in the order of
        their placeholder runs in its ids (TRL's processor expanded each run; SGLang's multimodal processor
        expands it again from the image, as for verl's requests). They reach the engine as ``image_data``,
        as TRL's vLLM colocate mode hands vLLM ``multi_modal_data`` (``trl/generation/vllm_generation.py``).

        In a TP group (:class:`~.trl_ranks.TPGroupRanks`) the leader generates every member's prompts and each
        rank gets its own back.

        Raises:
            RankFailedError: on a TP group's member, when its leader's call failed.
        """
        if self.group is not None:
            return self.group.generate(lambda ids, imgs: self._generate_here(trainer, ids, imgs), prompt_ids, images)
        return self._generate_here(trainer, prompt_ids, images)

    def _generate_here(self, trainer, prompt_ids, images):
        """:meth:`generate` on this process's engine."""
        self.wake(trainer.state.global_step, trainer._trainer_weights)
        mm = {"image_data": [list(i) if i else None for i in images]} if images is not None and any(images) else {}
        gens = self.worker.generate([list(p) for p in prompt_ids], sampling_params_of(trainer), n=1, **mm)
        return [list(g[0].output_ids) for g in gens], [list(g[0].logprobs) for g in gens]

    def sleep(self, raise_errors: bool) -> None:
        """Release the engine's memory for training (by ``sleep_level``); a failure is raised when
        ``raise_errors``, else logged (the generation's own error is the one to raise). Nothing on a TP
        group's member."""
        if not self.engine_here or not self.awake:
            return
        try:
            self.worker.sleep()
            self.awake = False
        except Exception:
            if raise_errors:
                raise
            logger.exception("the engine could not sleep after a failed generation")


def _make_class():
    """:class:`SglGRPOTrainer` on TRL's ``GRPOTrainer`` (imported only when TRL is asked for)."""
    base = _trainer_base()

    class SglGRPOTrainer(base):
        """TRL's ``GRPOTrainer`` whose completions come from SGLang through this package (module docstring).

        Args:
            *args, **kwargs: ``GRPOTrainer``'s.
            rollout: a :class:`~sgl_rollout.config.RolloutConfig` (the engine is started at the first
                generation, in this process, on this rank's GPU: :func:`rank_rollout_config`) or a ready
                :class:`~sgl_rollout.worker.RolloutWorker` (or anything with its ``generate``,
                ``update_weights`` and ``sleep``), this rank's.

        Raises:
            UnsupportedTRLVersion: the installed TRL is outside :data:`SUPPORTED_TRL`.
            ValueError: ``rollout`` is missing, or a setting this trainer does not serve yet (TRL's
                ``use_vllm``, DeepSpeed ZeRO-3 or FSDP, a TP size that does not divide the processes, tools
                with TP groups), in one line.
            LayoutError: several processes and no free port block (:func:`rank_rollout_config`).
        """

        def __init__(self, *args, rollout=None, **kwargs):
            check_trl_version()
            if rollout is None:
                raise ValueError("SglGRPOTrainer needs rollout=RolloutConfig(model_path=...) or a RolloutWorker")
            why = _refusal(kwargs.get("args"), kwargs.get("model"))
            if why:
                raise ValueError(why)
            super().__init__(*args, **kwargs)
            why = _refusal_after_init(self, rollout)
            if why:
                raise ValueError(why)
            self.sgl = _SglGeneration.of(rollout, self.accelerator)

        def _trainer_weights(self):
            """:func:`policy_weights` of this rank's replica."""
            return policy_weights(self.accelerator.unwrap_model(self.model))

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            """One completion per prompt in ``prompt_ids`` (``List[List[int]]``, this rank's) from SGLang
            (:meth:`_SglGeneration.generate`). The first call of a generation (not one of TRL's tool loop,
            whose calls differ in number between ranks) is :func:`agreed` between ranks.

            ``images`` (TRL's, one entry per prompt, a tool's images merged in) reach the engine as
            ``image_data``; ``multimodal_fields`` (the processor's tensors, for TRL's own forward passes) do
            not: SGLang's processor makes its own from the images.

            Raises:
                SyncValidationError, MemoryStateError, EngineDeadError: from the worker, unchanged: the
                    trainer's process lives and the engine keeps its last good weights where the refusal
                    came before the first byte.
                RankFailedError: another rank's call failed.
            """
            if self.sgl.in_tool_loop:
                return self.sgl.generate(self, prompt_ids, images)
            return agreed(lambda: self.sgl.generate(self, prompt_ids, images), self.accelerator)

        def _tool_call_loop(self, *args, **kwargs):
            """TRL's tool loop (each rank runs it once per generation when tools are set), :func:`agreed`."""
            self.sgl.in_tool_loop = True
            try:
                return agreed(lambda: super(SglGRPOTrainer, self)._tool_call_loop(*args, **kwargs), self.accelerator)
            finally:
                self.sgl.in_tool_loop = False

        def _generate(self, prompts):
            """TRL's ``_generate`` (templating, the tool loop, decoding, its gathers), then the engine sleeps
            until the next step's generation (:func:`agreed` between ranks)."""
            try:
                out = super()._generate(prompts)
            except BaseException:
                self.sgl.sleep(raise_errors=False)
                raise
            agreed(lambda: self.sgl.sleep(raise_errors=True), self.accelerator)
            return out

    return SglGRPOTrainer


def __getattr__(name: str):
    """``SglGRPOTrainer`` is made on first import, after :func:`check_trl_version` (a missing or unsupported
    TRL is refused there, in one line, before TRL's own import can fail another way)."""
    if name == "SglGRPOTrainer":
        check_trl_version()
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = ["PER_RANK_SERVER_ARGS", "RankFailedError", "SUPPORTED_TRL", "TRL_REQUIREMENT", "SglGRPOTrainer",
           "TPGroupRanks", "UnsupportedTRLVersion", "agreed", "check_trl_version", "merged_adapter_weights",
           "policy_weights", "rank_rollout_config", "sampling_params_of"]
