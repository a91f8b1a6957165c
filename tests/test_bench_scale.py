"""``python -m sgl_rollout.bench scale`` on the CPU: model sizes from the shapes, the TP choice, the rows."""

import json

import pytest

from sgl_rollout.bench import __main__ as bench_main
from sgl_rollout.bench import scale


@pytest.mark.parametrize("shape,known", zip(scale.SHAPES, (6.74e9, 70.6e9, 405.9e9)))
def test_parameter_counts_match_the_published_models(shape, known):
    assert shape.params() == pytest.approx(known, rel=0.02)


def test_tp_choice_and_a_400b_replica_over_two_nodes():
    tps = [scale.choose_tp(s.params() * 2, 80e9, 0.65) for s in scale.SHAPES]
    assert tps == [1, 4, 16]
    with pytest.raises(ValueError, match="does not fit"):
        scale.choose_tp(1e15, 80e9, 0.65)


def test_rows_follow_from_the_inputs(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "X", "results": {"flat_2048m": {"gb_per_s": 100.0},
                                                            "fast_2048m": {"gb_per_s": 200.0}}}))
    table = scale.rows(bench_path=str(bench))
    assert len(table) == 9
    big = [r for r in table if r["model"].startswith("400B")]
    assert [r["fits"] for r in big] == [False, True, True]
    r = big[2]
    nbytes = scale.SHAPES[2].params() * 2
    assert (r["tp"], r["nodes_per_replica"], r["replicas"]) == (16, 2, 1000 // 16)
    assert r["shard_gb"] == pytest.approx(nbytes / 16 / 1e9) and r["sync_gb_per_gpu"] == pytest.approx(nbytes / 1e9)
    assert r["sync_s_flat"] == pytest.approx(nbytes / 1e9 / 100) and r["sync_s_fast"] == pytest.approx(nbytes / 1e9 / 200)
    assert r["leader_bytes_per_sync"] > 16 * r["buckets"] * 400  # metadata on top of the handles


def test_metadata_is_measured_with_sglangs_class_and_grows_with_the_tensors():
    small, big = (scale.metadata_bytes(s) for s in scale.SHAPES[:2])
    per_tensor = small / len(scale.SHAPES[0].tensors())
    assert big > small and 40 < per_tensor < 400  # a name of ~40 characters, a shape, a dtype, two offsets


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert bench_main.main(["scale", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "| 400B-class (Llama-3.1-405B) | 1000 | 16 (2) |" in text and "bandwidth: " in text
    assert len(json.loads(out.read_text())) == 9
