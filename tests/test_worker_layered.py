"""RolloutWorker with ``layered_summon``: buckets close at decoder-layer boundaries (CPU, engine double)."""

import torch

from fakes import FakeSGLangEngine
from sgl_rollout.config import RolloutConfig
from sgl_rollout.engine import RolloutEngine
from sgl_rollout.weight_sync.layered import iter_layered
from sgl_rollout.weight_sync.manifest import WeightManifest
from sgl_rollout.worker import RolloutWorker


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.bfloat16)


def _syncs(layered):
    model = _tiny_llama()
    config = RolloutConfig(model_path="/fake", layered_summon=layered, update_weights_bucket_megabytes=64)
    engine = RolloutEngine(config, engine_factory=FakeSGLangEngine, watch_interval_s=0.05)
    worker = RolloutWorker(config, engine=engine)
    worker.manifest = WeightManifest.from_named_tensors([(n, p.detach()) for n, p in model.named_parameters()])
    try:
        worker.sleep()
        stats = worker.update_weights(iter_layered(model))
        updates = [c for c in engine._engine.calls if c[0] == "update_weights"]
        return stats, updates
    finally:
        worker.shutdown()


def test_layered_summon_closes_a_bucket_per_layer_and_sends_everything():
    flat_stats, flat_updates = _syncs(False)
    stats, updates = _syncs(True)
    assert len(flat_updates) == 1  # everything fits one 64 MiB bucket
    # embed, 3 decoder layers, final norm, lm_head: one bucket each
    assert len(updates) == stats.n_buckets == 6
    assert stats.n_tensors == flat_stats.n_tensors and stats.bytes == flat_stats.bytes
