"""``python -m sgl_rollout.bench p2p`` on the CPU (gloo between two processes): the command's plumbing; the
figures of the wire come from two GPUs (NCCL), next to a plain copy."""

import json

from sgl_rollout.bench import p2p
from sgl_rollout.bench.__main__ import build_parser, main


def test_the_sweep_moves_every_size_and_prints_a_row_each(tmp_path, capsys):
    res = p2p.sweep([0.000_5, 0.002], repeats=2, cuda=False)
    assert [r["bytes"] for r in res["rows"]] == [500_000, 2_000_000]
    assert all(r["p2p_gb_per_s"] > 0 and r["copy_gb_per_s"] is None for r in res["rows"])
    lines = p2p.print_table(res)
    assert len(lines) == 4 and lines[2].split()[0] == "0.001" and "nan" in lines[2]


def test_the_command_line_defaults_to_0_1_to_16_gb_and_writes_its_json(tmp_path, monkeypatch):
    args = build_parser().parse_args(["p2p"])
    assert args.sizes_gb[0] == 0.1 and args.sizes_gb[-1] == 16.0 and args.repeats == 5
    monkeypatch.setattr(p2p, "sweep", lambda sizes, repeats: {"device": "x", "repeats": repeats, "rows": [
        {"bytes": int(s * 1e9), "p2p_gb_per_s": 100.0, "copy_gb_per_s": 200.0} for s in sizes]})
    out = tmp_path / "p2p.json"
    assert main(["p2p", "--sizes-gb", "0.1", "1", "--repeats", "3", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["bytes"] for r in got["rows"]] == [100_000_000, 1_000_000_000] and got["repeats"] == 3


def test_out_may_name_a_folder_and_the_json_lands_in_it(tmp_path, monkeypatch):
    """The fifth session's queue gave ``--out`` a folder (as ``bench verl`` takes); the sweep ran to its end
    and the write failed with IsADirectoryError. A folder, existing or ending in ``/``, gets bench_p2p.json."""
    monkeypatch.setattr(p2p, "sweep", lambda sizes, repeats: {"device": "x", "repeats": repeats, "rows": []})
    folder = tmp_path / "res"
    folder.mkdir()
    assert main(["p2p", "--sizes-gb", "0.1", "--out", str(folder)]) == 0
    assert json.loads((folder / "bench_p2p.json").read_text())["device"] == "x"
    assert main(["p2p", "--sizes-gb", "0.1", "--out", str(tmp_path / "new") + "/"]) == 0
    assert (tmp_path / "new" / "bench_p2p.json").is_file()
    assert main(["p2p", "--sizes-gb", "0.1", "--out", str(tmp_path / "deep" / "p.json")]) == 0
    assert (tmp_path / "deep" / "p.json").is_file()
