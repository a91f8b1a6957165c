"""The shapes task of ``bench verl --task shapes`` (``sgl_rollout.bench.vlm``), checked on CPU against
verl's own code: its parquet rows in the geometry3k layout (images as PNG bytes) that verl's
``RLHFDataset`` reads with ``data.image_key=images``, the reward function verl loads from the config
keys, and the side commands composed into verl's config by hydra. The dataset's image path needs the
tiny model's processor, which needs torchvision (not on the CPU machines): it runs in verl's trainer on
the GPU host."""

import io

import numpy as np
import pyarrow.parquet as pq
import pytest

from sgl_rollout.bench import verl_compare
from sgl_rollout.bench import verl_trainers, vlm

from test_verl_task import trainer_config  # noqa: E402


def test_parquet_rows_hold_a_png_of_the_answers_colour(tmp_path):
    from PIL import Image

    train, val = vlm.write_shapes_parquet(tmp_path / "data", n_train=24, n_val=8, seed=1)
    rows = pq.read_table(train).to_pylist()
    assert len(rows) == 24 and len(pq.read_table(val).to_pylist()) == 8
    for row in rows:
        assert row["data_source"] == vlm.SHAPES_SOURCE and row["prompt"][0]["content"].startswith("<image>")
        color = row["reward_model"]["ground_truth"]
        assert color == row["extra_info"]["color"] and row["extra_info"]["split"] == "train"
        picture = np.asarray(Image.open(io.BytesIO(row["images"][0]["bytes"])))
        assert picture.shape == (84, 112, 3)
        assert (picture == vlm.COLORS[color]).all(-1).sum() > 300  # the shape, in its colour
        others = [c for c in vlm.COLORS if c != color]
        assert not any((picture == vlm.COLORS[c]).all(-1).any() for c in others)
    assert len({r["images"][0]["bytes"] for r in rows}) == 24  # places differ
    assert {r["reward_model"]["ground_truth"] for r in rows} == set(vlm.COLORS)
    again, _ = vlm.write_shapes_parquet(tmp_path / "again", n_train=24, n_val=8, seed=1)
    assert pq.read_table(again).to_pylist() == rows
    val_rows = pq.read_table(val).to_pylist()
    assert not {r["images"][0]["bytes"] for r in val_rows} & {r["images"][0]["bytes"] for r in rows}
    with pytest.raises(ValueError, match="at least one row"):
        vlm.write_shapes_parquet(tmp_path / "none", n_train=0)


@pytest.mark.parametrize("text, gt, acc, score", [
    ("Red.", "red", 1.0, 1.0), ("The shape is blue", "blue", 1.0, 1.0),
    ("green, no, red", "red", 0.0, 0.5 * 2 / 3),  # "green, n" holds r and e of "red": partial credit only
    ("grey", "red", 0.0, 0.5 * 2 / 3), ("", "blue", 0.0, 0.0), ("\x07zq#", "green", 0.0, 0.0),
    ("xxxxxxxxred", "red", 1.0, 1.0),  # named after the head: full credit all the same
    ("xxxxxxxxrd", "red", 0.0, 0.0),  # letters after the head earn nothing
])
def test_shapes_score(text, gt, acc, score):
    got = vlm.shapes_score(vlm.SHAPES_SOURCE, text, gt)
    assert got["acc"] == acc and got["score"] == pytest.approx(score)
    with pytest.raises(ValueError, match="scores"):
        vlm.shapes_score("openai/gsm8k", text, gt)


def test_with_overrides_replaces_same_keys_and_appends_new_ones():
    base = ["a.b=1", "+c.d=2", "e=3"]
    assert verl_trainers.with_overrides(base, ["c.d=5", "f=6"]) == ["a.b=1", "e=3", "c.d=5", "f=6"]


def test_side_commands_compose_with_the_shapes_keys(tmp_path):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cmd = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 1, 1, 4, 0.5, python="python",
                                    task="shapes")
    overrides = cmd[3:]
    keys = [o.split("=", 1)[0].lstrip("+") for o in overrides]
    assert len(keys) == len(set(keys))
    cfg = trainer_config(overrides)
    assert cfg.data.image_key == "images"
    assert cfg.reward.custom_reward_function.path == "pkg://sgl_rollout.bench.vlm"
    fn = get_custom_reward_fn(cfg)  # verl's own loader, through the pkg:// path
    assert fn(vlm.SHAPES_SOURCE, "blue", "blue") == {"score": 1.0, "acc": 1.0}
    arith = verl_compare.side_command("ours", tmp_path / "m", tmp_path / "run", 1, 1, 4, 0.5, python="python")
    assert [o for o in arith if "image_key" in o or "bench.vlm" in o] == []
