"""A vision-language model through a real engine (issue 38): a tiny Qwen2.5-VL (random weights, made by
``sgl_rollout.bench.vlm``) with images and videos, against Hugging Face's
``Qwen2_5_VLForConditionalGeneration`` on the same weights and pixels.

* Images reach SGLang's multimodal processor as verl sends them (``PIL.Image``s beside prompt ids that
  carry the expanded placeholder runs), and greedy output equals Hugging Face's (bf16 near-ties only);
  two images give two different answers, so the image is not ignored.
* Videos reach it as verl 0.9.1 sends them (one ``{"format": "processor_output", ...}`` dict of the
  processor's features): two videos that share their first frames and differ in their last ones give
  different greedy answers; with one temporal patch each equals Hugging Face's (with two, SGLang's
  vision tower attends across the patches and Hugging Face's does not: see the test).
* A weight sync of a trainer holding transformers 5's names (``model.language_model.*``,
  ``model.visual.*``) lands in every parameter, the vision tower's included: the fast path's result is
  bit-identical to SGLang's own ``load_weights`` of the same weights, and greedy output with an image
  then equals Hugging Face's with the new weights.
"""

import copy

import numpy as np
import pytest
import torch

from sgl_rollout.bench import gpu_engine_flags
from sgl_rollout.config import RolloutConfig
from sgl_rollout.worker import RolloutWorker
from sgl_rollout.weight_sync.driver import fenced

from .greedy import NEAR_TIE

N = 12  # new tokens compared per request
GREEDY = {"temperature": 0.0, "max_new_tokens": N, "ignore_eos": True}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    pytest.importorskip("torchvision")  # transformers' Qwen2-VL video processor needs it (the GPU hosts have it)
    from transformers import AutoProcessor

    from sgl_rollout.bench.vlm import make_qwen2_5_vl_dir

    path = str(tmp_path_factory.mktemp("qwen2_5_vl"))
    model = make_qwen2_5_vl_dir(path)
    from sgl_rollout.engine.sglang_version import installed_sglang
    from sgl_rollout.patches.qwen2_5_vl_vision_rope import refusal

    why = refusal(path, installed_sglang())
    if why:  # the engine would refuse to start here (SGLang 0.5.10.post1's overlay): run it on 0.5.12
        pytest.skip(why)
    processor = AutoProcessor.from_pretrained(path)
    cfg = RolloutConfig(model_path=path, dtype="bfloat16", gpu_memory_utilization=0.2, enforce_eager=True,
                        fast_sync=True, update_weights_bucket_megabytes=1,
                        engine_kwargs={**gpu_engine_flags(), "mm_attention_backend": "sdpa"})
    worker = RolloutWorker(cfg)
    yield worker, model.cuda(), processor
    worker.shutdown()


def _picture(kind: str, h: int = 84, w: int = 112) -> np.ndarray:
    """An RGB uint8 picture (h, w, 3): a red box, a blue disc or green stripes on grey."""
    img = np.full((h, w, 3), 128, np.uint8)
    yy, xx = np.mgrid[:h, :w]
    if kind == "box":
        img[h // 4: 3 * h // 4, w // 5: w // 2] = (220, 30, 30)
    elif kind == "disc":
        img[(yy - h / 2) ** 2 + (xx - 2 * w / 3) ** 2 < (h / 3) ** 2] = (30, 30, 220)
    else:
        img[(xx // 8) % 2 == 0] = (30, 200, 30)
    return img


def _prompt(processor, part: str, text: str) -> str:
    messages = [{"role": "user", "content": [{"type": part}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def _hf_logits(model, inputs, ids):
    """Hugging Face's logits (1, L, V) for ``ids`` (1, L): the processor's prompt ``inputs`` followed by
    generated tokens. transformers 5.9 places the mrope positions by ``mm_token_type_ids`` (one per
    prompt token); generated tokens are text (type 0)."""
    extra = {k: v.cuda() for k, v in inputs.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")}
    if "mm_token_type_ids" in inputs:
        types = inputs["mm_token_type_ids"].cuda()
        extra["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, ids.shape[1] - types.shape[1])], dim=1)
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False, **extra).logits


def _assert_hf_greedy(model, inputs, got) -> int:
    """Every token of ``got`` is Hugging Face's argmax after the prompt and the tokens before it, or within
    NEAR_TIE of it (tests/gpu/greedy.py says why); so ``got`` is Hugging Face's greedy continuation.
    Compared up to the first generated vision token included (random weights sometimes produce one;
    Hugging Face would take it fed back for a placeholder, SGLang as text). Returns the number of tokens
    compared (at least 4)."""
    vision = {model.config.image_token_id, model.config.video_token_id, model.config.vision_start_token_id}
    n = next((i + 1 for i, t in enumerate(got) if t in vision), len(got))
    assert n >= 4, got
    prompt = inputs["input_ids"].cuda()
    fed = torch.cat([prompt, torch.tensor([got[:n - 1]], device="cuda", dtype=prompt.dtype)], dim=1)
    logits = _hf_logits(model, inputs, fed)[0, prompt.shape[1] - 1:].float()
    gap = logits.max(-1).values - logits.gather(-1, torch.tensor(got[:n], device="cuda")[:, None])[:, 0]
    assert float(gap.max()) < NEAR_TIE, (got, logits.argmax(-1).tolist(), gap.tolist())
    return n


def _image_request(worker, processor, picture):
    from PIL import Image

    image = Image.fromarray(picture)
    inputs = processor(text=[_prompt(processor, "image", "What is drawn here?")], images=[image], return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    gen = worker.engine.generate([ids], GREEDY, image_data=[[image]])[0][0]
    return inputs, list(gen.output_ids)


def test_image_greedy_equals_hugging_face(vlm):
    worker, model, processor = vlm
    answers = []
    for kind in ("box", "disc"):
        inputs, got = _image_request(worker, processor, _picture(kind))
        n_pad = int((inputs["input_ids"][0] == model.config.image_token_id).sum())
        assert n_pad == int(inputs["image_grid_thw"].prod()) // 4 > 1
        assert len(got) == N
        n = _assert_hf_greedy(model, inputs, got)
        answers.append(got)
        print(f"\nVLM image {kind}: {n_pad} image tokens, {n} tokens == HF greedy")
    assert answers[0] != answers[1], "two images gave the same answer: the image did not reach the model"


def _video_request(worker, processor, frames):
    # 2 frames a second, Qwen2.5-VL's own rate: 1 s per temporal patch. transformers 5.9 truncates
    # second_per_grid_ts to an int for the mrope positions (get_rope_index) while SGLang multiplies the
    # float, so at transformers' default 24 fps (0.083 s) the two place the frames differently
    inputs = processor(text=[_prompt(processor, "video", "What happens?")], videos=[frames], return_tensors="pt",
                       video_metadata=[{"total_num_frames": len(frames), "fps": 2.0}])
    assert inputs["second_per_grid_ts"].tolist() == [1.0]
    payload = {"format": "processor_output", "pixel_values_videos": inputs["pixel_values_videos"],
               "video_grid_thw": inputs["video_grid_thw"]}
    if "second_per_grid_ts" in inputs:
        payload["second_per_grid_ts"] = inputs["second_per_grid_ts"]
    ids = inputs["input_ids"][0].tolist()
    gen = worker.engine.generate([ids], GREEDY, video_data=[[payload]])[0][0]
    return inputs, list(gen.output_ids)


def _hf_prefix(model, inputs, got) -> int:
    """How many leading tokens of ``got`` are Hugging Face's argmax (within NEAR_TIE) after the prompt and
    the tokens before them."""
    prompt = inputs["input_ids"].cuda()
    fed = torch.cat([prompt, torch.tensor([got[:-1]], device="cuda", dtype=prompt.dtype)], dim=1)
    logits = _hf_logits(model, inputs, fed)[0, prompt.shape[1] - 1:].float()
    gap = logits.max(-1).values - logits.gather(-1, torch.tensor(got, device="cuda")[:, None])[:, 0]
    bad = (gap >= NEAR_TIE).nonzero()
    return int(bad[0, 0]) if len(bad) else len(got)


@pytest.mark.parametrize("n_frames", [2, 4])
def test_video_output_depends_on_the_frames(vlm, n_frames):
    """Two videos sharing their first frame(s) and differing in the last give different greedy answers.

    With 2 frames (one temporal patch of Qwen2.5-VL's 2) each answer also equals Hugging Face's greedy.
    With 4 frames (two temporal patches) only the dependence on the frames is asserted: SGLang 0.5.12's
    vision tower lets the patches of all of a video's temporal patches attend to each other in its
    full-attention blocks (``cu_seqlens`` by ``t * h * w``, ``models/qwen2_5_vl.py``), Hugging Face's one
    temporal patch at a time (``get_vision_cu_seqlens``); the answers part after a few tokens (printed)."""
    worker, model, processor = vlm
    half = n_frames // 2
    first = [_picture("box", 56, 84)] * half
    answers = []
    for last in ("disc", "stripes"):
        frames = np.stack(first + [_picture(last, 56, 84)] * half)  # (T, H, W, 3) uint8
        inputs, got = _video_request(worker, processor, frames)
        assert int(inputs["video_grid_thw"][0, 0]) == n_frames // 2  # temporal patches of 2 frames
        if n_frames == 2:
            n = _assert_hf_greedy(model, inputs, got)
            print(f"\nVLM video of 2 frames ending in {last}: {n} tokens == HF greedy")
        else:
            print(f"\nVLM video of {n_frames} frames ending in {last}: first {_hf_prefix(model, inputs, got)} of "
                  f"{len(got)} tokens == HF greedy (SGLang attends across temporal patches)")
        answers.append(got)
    assert answers[0] != answers[1], "videos differing only in their last frames gave the same answer"


def _digest(worker):
    with fenced(worker.engine):
        return worker._fast.digest()


def test_vision_tower_synced_bit_exact_on_the_fast_path(vlm):
    from sgl_rollout.bench.vlm import redraw

    worker, a, processor = vlm
    b = copy.deepcopy(a)
    redraw(b, seed=1)
    names = [n for n, _ in b.named_parameters()]
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.") for n in names)

    def params(m):
        return [(n, p.detach()) for n, p in m.named_parameters()]

    worker.update_weights(params(b))
    assert worker._fast is not None and worker._fast.covered, worker._fast and worker._fast.reason
    fast = _digest(worker)
    assert any(n.startswith("visual.") for n in fast[0]), sorted(fast[0])[:5]
    worker.update_weights(params(a), partial=True)  # SGLang's own load_weights, checkpoint names
    other = _digest(worker)
    worker.update_weights(params(b), partial=True)
    slow = _digest(worker)
    changed = [n for n in fast[0] if fast[0][n] != other[0][n]]
    assert any(n.startswith("visual.") for n in changed), "the vision tower did not change with the weights"
    assert slow == fast, [n for n in fast[0] if fast[0][n] != slow[0][n]]
    worker.update_weights(params(b))  # the fast path again, then generate with an image on b
    # the engine saw this picture with weights a (test_image_greedy_equals_hugging_face): SGLang's
    # multimodal embedding cache still held its old vision features until the receiver emptied it
    inputs, got = _image_request(worker, processor, _picture("box"))
    n = _assert_hf_greedy(b, inputs, got)
    print(f"\nVLM fast path: {len(fast[0])} parameters bit-exact vs SGLang load_weights "
          f"({sum(k.startswith('visual.') for k in fast[0])} in the vision tower); image greedy == HF after the sync "
          f"({n} tokens)")
