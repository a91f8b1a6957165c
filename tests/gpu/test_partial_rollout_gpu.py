"""Partial rollout on a real engine (issue 39): a greedy request aborted mid-generation (what verl's
``abort_all_requests`` does before a weight update) comes back with the tokens made so far, the old
weights' greedy prefix; after the update, the request resent as prompt + partial tokens continues as the
new weights' greedy continuation, so no KV-cache prefix computed with the old weights was reused, and a
fresh identical request gives the same tokens."""

import threading
import time

import pytest
import torch

from sgl_rollout.bench import LLAMA_TINY, gpu_engine_flags, make_llama_dir
from sgl_rollout.config import RolloutConfig
from sgl_rollout.worker import RolloutWorker

from .greedy import PROMPTS, assert_greedy_equal, engine_greedy, hf_greedy, new_weights

LONG = 900  # more than the abort leaves time for (the tiny model's context is 1,024)
CHECKED = 48  # tokens of the partial answer compared with Hugging Face's greedy (its cost grows with n^2)
CONTINUE = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny"))
    model = make_llama_dir(path, LLAMA_TINY, dtype=torch.bfloat16, with_weights=True, init_std=0.15)
    cfg = RolloutConfig(model_path=path, dtype="bfloat16", gpu_memory_utilization=0.15, enforce_eager=True,
                        engine_kwargs=gpu_engine_flags())
    worker = RolloutWorker(cfg)
    yield worker, model.cuda().eval()
    worker.shutdown()


def test_aborted_request_keeps_its_tokens_and_continues_on_the_new_weights(tiny):
    worker, model = tiny
    prompt = PROMPTS[0]
    out = {}

    def long_request():
        out["gen"] = worker.generate([prompt], {"temperature": 0.0, "max_new_tokens": LONG, "ignore_eos": True})[0][0]

    t = threading.Thread(target=long_request)
    t.start()
    for _ in range(1000):
        if worker.engine.state.in_flight:
            break
        time.sleep(0.002)
    time.sleep(0.3)  # some tokens in
    t0 = time.perf_counter()
    worker.engine.abort_all()
    t.join(timeout=60)
    assert not t.is_alive()
    gen = out["gen"]
    partial = list(gen.output_ids)
    print(f"\naborted after {len(partial)} of {LONG} tokens; returned {time.perf_counter() - t0:.3f} s after the abort")
    assert gen.finish_reason == "abort" and CHECKED <= len(partial) < LONG
    assert len(gen.logprobs) == len(partial)
    assert_greedy_equal(model, [prompt], [partial[:CHECKED]])  # the old weights' greedy tokens

    resent = prompt + partial
    old_continuation = hf_greedy(model, [resent], CONTINUE)[0]
    new_weights(model, 11)
    worker.sleep()
    worker.update_weights(model.named_parameters())
    continued = engine_greedy(worker, [resent], CONTINUE)[0]
    assert_greedy_equal(model, [resent], [continued])  # the new weights, no stale prefix
    assert continued != old_continuation  # and the new weights change the answer
    assert engine_greedy(worker, [resent], CONTINUE)[0] == continued  # a fresh identical request
