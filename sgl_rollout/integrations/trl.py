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

Not yet served (each refused in one line, at start-up or at the call): TRL's ``use_vllm``, models under
DeepSpeed ZeRO-3 or FSDP (their parameters must be gathered first), PEFT models, more than one process
(``accelerate launch`` with 2), and images. TRL's tool-call loop calls the same seam; no test runs it yet. Ran on the CPU
only (``tests/test_trl.py``, real ``GRPOTrainer`` with an engine double); no GPU run yet.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

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


def sampling_params_of(trainer) -> Dict[str, Any]:
    """SGLang sampling parameters equal to the ones TRL's own generation uses (``GRPOTrainer.__init__``'s
    ``generation_kwargs``): ``max_new_tokens`` = ``max_completion_length``, ``temperature``, ``top_p``,
    ``top_k`` (None or 0: off, SGLang's -1), ``min_p`` (None: 0), ``repetition_penalty``, and the trainer's
    end-of-sequence ids as ``stop_token_ids``."""
    params = {"max_new_tokens": int(trainer.max_completion_length), "temperature": float(trainer.temperature),
              "top_p": float(trainer.top_p), "top_k": int(trainer.top_k) if trainer.top_k else -1,
              "min_p": float(trainer.min_p or 0.0), "repetition_penalty": float(trainer.repetition_penalty or 1.0)}
    eos = [int(t) for t in (trainer.eos_token_ids or [])]
    if eos:
        params["stop_token_ids"] = eos
    return params


def _refusal(args, model) -> Optional[str]:
    """Why this trainer cannot serve ``args`` / ``model`` yet (None: it can)."""
    if getattr(args, "use_vllm", False):
        return "use_vllm=True: SglGRPOTrainer generates on SGLang; leave use_vllm False"
    if getattr(model, "peft_config", None):
        return "a PEFT model: SglGRPOTrainer does not merge or serve adapters yet"
    return None


def _refusal_after_init(trainer) -> Optional[str]:
    """Why a built trainer cannot be served yet (None: it can): sharded parameters, or several processes
    (one engine per rank is not built yet)."""
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return "DeepSpeed or FSDP: SglGRPOTrainer gathers no sharded parameters yet"
    if trainer.accelerator.num_processes > 1:
        return (f"{trainer.accelerator.num_processes} processes: SglGRPOTrainer runs one process (one engine) "
                "so far")
    return None


class _SglGeneration:
    """The generation side of :class:`SglGRPOTrainer` (its ``sgl``): the worker, made on first use from a
    :class:`~sgl_rollout.config.RolloutConfig`, whether the engine is awake, and the training step whose
    weights it holds."""

    def __init__(self, rollout):
        self._rollout, self.synced_step, self.awake = rollout, None, False

    @property
    def worker(self):
        from ..config import RolloutConfig
        from ..worker import RolloutWorker

        if isinstance(self._rollout, RolloutConfig):
            self._rollout = RolloutWorker(self._rollout)
        return self._rollout

    def wake(self, step: int, weights) -> None:
        """Make the engine ready to generate with step ``step``'s weights: the staged wake with a weight
        sync (``weights()``: the trainer's ``(name, tensor)`` pairs) when the step changed or the engine
        sleeps (a sleep may have released the weights; a sync is always right, a wake without one is not
        at sleep level 2)."""
        if self.awake and self.synced_step == step:
            return
        self.worker.update_weights(weights())
        self.synced_step, self.awake = step, True

    def sleep(self, raise_errors: bool) -> None:
        """Release the engine's memory for training (by ``sleep_level``); a failure is raised when
        ``raise_errors``, else logged (the generation's own error is the one to raise)."""
        if not self.awake:
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
                generation, in this process, on this rank's GPU) or a ready
                :class:`~sgl_rollout.worker.RolloutWorker` (or anything with its ``generate``,
                ``update_weights`` and ``sleep``).

        Raises:
            UnsupportedTRLVersion: the installed TRL is outside :data:`SUPPORTED_TRL`.
            ValueError: ``rollout`` is missing, or a setting this trainer does not serve yet (TRL's
                ``use_vllm``, a PEFT model, DeepSpeed ZeRO-3 or FSDP, several processes), in one line.
        """

        def __init__(self, *args, rollout=None, **kwargs):
            check_trl_version()
            if rollout is None:
                raise ValueError("SglGRPOTrainer needs rollout=RolloutConfig(model_path=...) or a RolloutWorker")
            why = _refusal(kwargs.get("args"), kwargs.get("model"))
            if why:
                raise ValueError(why)
            super().__init__(*args, **kwargs)
            why = _refusal_after_init(self)
            if why:
                raise ValueError(why)
            self.sgl = _SglGeneration(rollout)

        def _trainer_weights(self) -> List[Tuple[str, Any]]:
            """The policy's parameters, Hugging Face names, as the engine is to hold them."""
            model = self.accelerator.unwrap_model(self.model)
            return [(n, p.detach()) for n, p in model.named_parameters()]

        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations,
                                  has_tool_images=False):
            """One completion per prompt in ``prompt_ids`` (``List[List[int]]``) from SGLang, after the
            staged wake with the trainer's weights when the step changed; ``(completion ids, logprobs)``,
            both ``List[List]``, in prompt order.

            Raises:
                NotImplementedError: images (not served yet).
                SyncValidationError, MemoryStateError, EngineDeadError: from the worker, unchanged: the
                    trainer's process lives and the engine keeps its last good weights where the refusal
                    came before the first byte.
            """
            if (images is not None and any(images)) or has_tool_images or multimodal_fields:
                raise NotImplementedError("images: SglGRPOTrainer generates text only so far")
            self.sgl.wake(self.state.global_step, self._trainer_weights)
            gens = self.sgl.worker.generate([list(p) for p in prompt_ids], sampling_params_of(self), n=1)
            completion_ids = [list(g[0].output_ids) for g in gens]
            logprobs = [list(g[0].logprobs) for g in gens]
            return completion_ids, logprobs

        def _generate(self, prompts):
            """TRL's ``_generate`` (templating, the tool loop, decoding), then the engine sleeps until the
            next step's generation."""
            ok = False
            try:
                out = super()._generate(prompts)
                ok = True
                return out
            finally:
                self.sgl.sleep(raise_errors=ok)

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


__all__ = ["SUPPORTED_TRL", "TRL_REQUIREMENT", "SglGRPOTrainer", "UnsupportedTRLVersion", "check_trl_version",
           "sampling_params_of"]
