"""The verl rollout features, served by verl 0.9.1's built-in SGLang server and by this package.

One :class:`Feature` per row of the README's feature matrix (:func:`markdown` writes the table, and
``tests/test_feature_matrix.py`` checks that the README holds exactly it). The built-in column is read from
verl 0.9.1's ``verl/workers/rollout/sglang_rollout/async_sglang_server.py`` (``SGLangHttpServer``: the
server arguments it builds and its ``generate``) and ``verl/workers/rollout/llm_server.py``. For this
package, each served feature names the test that covers it, and each refused one either the rollout
config that :func:`~.verl_config.check_verl_features` refuses at start-up (one line naming the key and
the alternative), or the test of the per-request refusal where no config key selects the feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass(frozen=True)
class Feature:
    """One row of the matrix.

    Attributes:
        name: the feature, in verl's terms.
        builtin: verl 0.9.1's built-in SGLang server serves it.
        ours: this package serves it.
        test: ``tests/<file>.py::<test>`` covering it here (served), or covering its refusal.
        refused_by: for a refused feature selected by config, the rollout config (nested dict of
            ``actor_rollout_ref.rollout`` keys) that :func:`~.verl_config.check_verl_features` refuses,
            and the key its message names.
        note: what the row does not say by itself (where it was run, what is left).
    """

    name: str
    builtin: bool
    ours: bool
    test: str
    refused_by: Optional[Tuple[Dict[str, Any], str]] = None
    note: str = field(default="")


_TOOL_AGENT = "tests/test_tool_agent.py::test_verls_agent_loop_worker_runs_tool_single_turn_and_custom_loops_through_this_package"
_MM = "tests/test_multimodal.py::test_verls_client_images_and_video_reach_sglang_as_verls_builtin_server_sends_them"
_CPU_ONLY = "CPU (verl's real classes, engine double); not yet on a GPU"

FEATURES: List[Feature] = [
    Feature("agent loop `single_turn_agent`", True, True, _TOOL_AGENT, note="CPU; on GPU through every `bench verl` run"),
    Feature("agent loop `tool_agent` (multi-turn tools: function tools, `BaseTool`)", True, True, _TOOL_AGENT,
            note=_CPU_ONLY),
    Feature("custom agent loop registered by name (`agent_loop_config_path`)", True, True, _TOOL_AGENT,
            note="4×H200, SGLang 0.5.12, `bench verl --task tools` (3-turn episodes with tool responses, a loop "
                 "registered by name): 3 steps each side; greedy validation 128 of 128 == the built-in's before "
                 "and after training; 127 of 127 episodes token-equal in every turn "
                 "(examples/verl/compare/tools-3turn-h200x4)"),
    Feature("partial rollout (`abort_all_requests` / `resume_generation`, weight versions)", True, True,
            "tests/test_tool_agent.py::test_a_turn_cut_by_a_weight_update_comes_back_partial_and_the_episode_continues_after_resume",
            note="CPU, and a 1,000-request stress (tests/test_partial_rollout.py); on an H100 an abort keeps "
                 "the tokens made and the continuation runs on the new weights (tests/gpu/test_partial_rollout_gpu.py); "
                 "verl's fully-async trainer with `partial_rollout=True`, 3 steps each side on 4×H200 "
                 "(examples/verl/compare/fully-async-smollm2-h200x4)"),
    Feature("images (`image_data`)", True, True, "tests/gpu/test_vlm_gpu.py::test_image_greedy_equals_hugging_face",
            note="H100 and H200, SGLang 0.5.12: tiny Qwen2.5-VL greedy == Hugging Face's; vision tower synced "
                 "bit-exact (`test_vision_tower_synced_bit_exact_on_the_fast_path`); verl's GRPO, `bench verl --task "
                 "shapes` on 2×H200: 3 steps each side, greedy validation 46 of 46 == the built-in's before training "
                 "and after step 3; the built-in syncs a Qwen2.5-VL only with `patches/qwen_vl_weight_names.py` "
                 "registered (verl 0.9.1 sends transformers 5's names)"),
    Feature("video (`video_data`, the processor-output dict verl sends SGLang)", True, True,
            "tests/gpu/test_vlm_gpu.py::test_video_output_depends_on_the_frames",
            note="H200, SGLang 0.5.12 only (0.5.10.post1's Qwen-VL processor fails such a request with a "
                 "ValueError, read in its source), with `patches/qwen_vl_processor_output.py` (SGLang gave the "
                 "video the positions of text): one temporal patch == Hugging Face's greedy, two temporal patches "
                 "change the answer with the frames (SGLang's vision tower attends across a video's patches, "
                 "Hugging Face's does not); verl's client on CPU (`tests/test_multimodal.py`)"),
    Feature("audio (`audio_data`), per-request `mm_processor_kwargs`", False, False,
            "tests/test_multimodal.py::test_server_refuses_audio_and_per_request_processor_kwargs_before_sglang",
            note="refused per request (no config key selects it)"),
    Feature("`prompt_logprobs` (distillation teacher's request)", True, True,
            "tests/test_prompt_logprobs.py::test_verl_teacher_request_gets_what_verls_sglang_server_returns",
            note="CPU"),
    Feature("teacher / reward-model replicas (`is_teacher_model`, `is_reward_model`)", True, False,
            "tests/test_verl_config.py::test_reward_and_teacher_replicas_and_rl_insight_are_refused",
            note="refused when the replica is built, naming the key"),
    Feature("LoRA, merged into the synced weights (`lora.merge=True`)", True, True,
            "tests/test_verl_rollout.py::test_verl_lora_settings_map_and_refuse"),
    Feature("LoRA served as an adapter (hot-swapped)", True, True,
            "tests/test_verl_rollout.py::test_verl_lora_adapter_sequence_sends_base_once"),
    Feature("FP8 rollout (`quantization=fp8`)", True, True,
            "tests/test_verl_config.py::test_adapter_quantizes_fp8_before_the_sync"),
    Feature("other quantization", False, False, "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"quantization": "awq"}, "quantization")),
    Feature("tensor parallel (`tensor_model_parallel_size`)", True, True,
            "tests/test_verl_rollout.py::test_checkpoint_engine_worker_tp2_async_generator"),
    Feature("data parallel with DP attention (`data_parallel_size` + `enable_dp_attention`)", True, True,
            "tests/test_verl_config.py::test_data_parallel_size"),
    Feature("data parallel without DP attention", True, False, "tests/test_verl_config.py::test_data_parallel_size",
            refused_by=({"data_parallel_size": 2}, "data_parallel_size")),
    Feature("expert parallel (`expert_parallel_size`)", True, True,
            "tests/test_verl_config.py::test_expert_parallel_size_reaches_sglang_as_ep_size", note="mapping only"),
    Feature("mixture-of-experts weight sync (Qwen3-MoE; transformers 5's fused experts split into checkpoint "
            "tensors)", True, True, "tests/test_moe_plan.py::test_moe_fast_path_equals_the_loader_bit_for_bit",
            note="4×H200, SGLang 0.5.12 (tests/gpu/test_moe_gpu.py, 4 passed): a Qwen3-MoE of 8 experts through the "
                 "fast path bit-exact against SGLang's `load_weights` at TP=1, TP=2 and EP=2, and through the "
                 "`sgl_rollout` checkpoint engine from another GPU (per-expert and fused names), greedy == Hugging "
                 "Face's each time. A head_dim SGLang's Qwen3-MoE cannot serve (32) is refused before start "
                 "(`fused_kv_rope_problem`). A colocated GRPO pair on it, both sides at once, one H200 each: "
                 "`timing_s/update_weights` 0.599 against the built-in's 0.741 s "
                 "(examples/verl/compare/qwen3-moe-random-h200x4)"),
    Feature("the trainer's FSDP2 weights gathered one unit (layer) at a time (`SGLROLLOUT_LAYERED_GATHER=1`)",
            False, True, "tests/test_verl_gather.py::test_same_names_order_and_values_as_verls_per_tensor_gather",
            note="CPU (FSDP2 over gloo): the same names, order and values as verl's per-tensor gather; off by "
                 "default: on 4×H200 (colocated 1.1B, TP=2) no gain, 0.746 against 0.730 s "
                 "(examples/verl/compare/colocated-1b-random-tp2-h200x4-layered)"),
    Feature("multi-node replicas (TP over nodes)", True, True, "tests/test_verl_multinode.py::test_verl_replica_over_two_nodes",
            note="4×H200, SGLang 0.5.12: tests/gpu/test_multinode_gpu.py (2 GPUs as two Ray nodes: one TP=2 replica, "
                 "sync, sleep, wake, restart); verl's own run with `bench verl --random-model 1b --ngpus 1 --tp 2 "
                 "--nnodes 2 --simulate-nodes`, 3 steps each side: `timing_s/update_weights` 0.778 s against the "
                 "built-in's 0.945 s, `timing_s/gen` 8.17 s against 6.78 s "
                 "(examples/verl/compare/simulated-nodes-1b-random-tp2-h200x4)"),
    Feature("`free_cache_engine`, sleep levels 1 and 2", True, True,
            "tests/test_verl_config.py::test_rollout_mode_decides_what_sleep_releases"),
    Feature("checkpoint-engine backends `naive`, `nccl`, `nixl`", True, True,
            "tests/test_verl_rollout.py::test_checkpoint_engine_worker_tp2_async_generator",
            note="2×H200, SGLang 0.5.12: verl's one-step-off trainer with this package's rollout on `nccl`, "
                 "SmolLM2-135M, 3 steps: `timing_s/sync_rollout_weights` 0.336 s against the built-in's 0.345 s "
                 "(examples/verl/compare/one-step-off-smollm2-h200x2-nccl); on the 1.1B shape, 4×H200: 0.372 s against"
                 " 0.369 s (examples/verl/compare/one-step-off-1b-random-h200x4-nccl); fully-async, SmolLM2, 4×H200: "
                 "`timing_s/param_sync` 0.297 s against 0.369 s "
                 "(examples/verl/compare/fully-async-smollm2-h200x4-nccl); fully-async on the 1.1B shape, 4×H200: "
                 "0.350 s against 0.535 s, `timing_s/gen` 1.97 s against 1.97 s "
                 "(examples/verl/compare/fully-async-1b-random-h200x4-nccl)"),
    Feature("checkpoint-engine backend `sgl_rollout` (each trainer rank sends each rollout TP rank only its shard, "
            "into the fast path's buffer)", False, True,
            "tests/test_p2p.py::test_verl_drives_the_backend_as_its_checkpoint_engine_manager_does",
            note="4×H200, SGLang 0.5.12: verl's fully-async trainer, SmolLM2-135M, 1 trainer + 1 rollout GPU a side: "
                 "`timing_s/param_sync` 0.078 s against the built-in's `nccl` 0.351 s, 3 steps each "
                 "(examples/verl/compare/fully-async-smollm2-h200x4); one-step-off on 2×H200, 3 steps: "
                 "`timing_s/sync_rollout_weights` 0.109 s against 0.345 s "
                 "(examples/verl/compare/one-step-off-smollm2-h200x2-sgl_rollout); one-step-off on the 1.1B shape, "
                 "4×H200 (sides in one lease): 0.101 s against 0.451 s, `timing_s/generate_async` 8.67 s against "
                 "10.11 s (examples/verl/compare/one-step-off-1b-random-h200x4-sgl_rollout); fully-async on the 1.1B "
                 "shape, both sides at once: `timing_s/param_sync` 0.086 s against 0.535 s, `timing_s/step` 9.45 s "
                 "against 10.33 s, `timing_s/gen` 2.15 s against 1.97 s "
                 "(examples/verl/compare/fully-async-1b-random-h200x4-sgl_rollout); `tests/gpu/test_p2p_gpu.py` "
                 "bit-exact against SGLang's `load_weights` on 2×H200"),
    Feature("checkpoint-engine backend `delta_sharded`", True, False,
            "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"checkpoint_engine": {"backend": "delta_sharded"}}, "checkpoint_engine.backend")),
    Feature("routing replay (`enable_rollout_routing_replay`)", True, False,
            "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"enable_rollout_routing_replay": True}, "enable_rollout_routing_replay")),
    Feature("MTP speculative rollout (`mtp.enable_rollout`)", True, False,
            "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"mtp": {"enable": True, "enable_rollout": True}}, "mtp.enable_rollout")),
    Feature("prefill/decode disaggregation", True, False,
            "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"disaggregation": {"enabled": True}}, "disaggregation.enabled")),
    Feature("Prometheus metrics (`prometheus.enable`)", True, False,
            "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"prometheus": {"enable": True}}, "prometheus.enable")),
    Feature("rollout profiler (discrete mode)", True, False,
            "tests/test_feature_matrix.py::test_each_refused_feature_is_refused_at_start_up",
            refused_by=({"profiler": {"enable": True, "tool": "torch", "tool_config": {"torch": {"discrete": True}}}},
                        "profiler.tool_config.<tool>.discrete")),
]


def markdown() -> str:
    """The README's feature-matrix table (Markdown), one row per :data:`FEATURES` entry."""
    mark = {True: "✓", False: "✗"}
    rows = ["| verl rollout feature | verl built-in | sgl-rollout | covered by | note |",
            "| --- | :---: | :---: | --- | --- |"]
    for f in FEATURES:
        rows.append(f"| {f.name} | {mark[f.builtin]} | {mark[f.ours]} | `{f.test.split('::')[-1]}` "
                    f"(`{f.test.split('::')[0]}`) | {f.note} |")
    return "\n".join(rows)
