"""The node layout of replicas (``sgl_rollout.engine.layout``): TP ranks, GPU ids and ports per node, on the CPU.

The TP ranks per node are checked against SGLang's own ``_calculate_rank_ranges`` (read from the installed
``sglang/srt/entrypoints/engine.py``: that module imports the serving stack, absent on the CPU test
machine, so the function's source is compiled alone).
"""

import ast
import itertools
import typing
from pathlib import Path

import pytest

from sgl_rollout.engine import layout
from sgl_rollout.engine.layout import PORTS_PER_REPLICA, LayoutError, plan_replicas


def sglang_rank_ranges():
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    src = (Path(spec.origin).parent / "srt" / "entrypoints" / "engine.py").read_text()
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef) and n.name == "_calculate_rank_ranges")
    ns = {"Tuple": typing.Tuple}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "sglang-engine", "exec"), ns)
    return ns["_calculate_rank_ranges"]


LAYOUTS = [(gpn, tp, nodes) for gpn, tp, nodes in itertools.product((2, 4, 8), (2, 4, 8, 16), (1, 2, 3, 4))
           if (tp <= gpn and gpn % tp == 0) or (tp > gpn and tp % gpn == 0 and (nodes * gpn) % tp == 0)]


@pytest.mark.parametrize("gpus_per_node,tp,nodes", LAYOUTS)
def test_every_gpu_once_tp_ranks_as_sglang_and_disjoint_ports(gpus_per_node, tp, nodes):
    reps = plan_replicas(nodes * gpus_per_node, tp, gpus_per_node)
    assert len(reps) == nodes * gpus_per_node // tp
    rank_ranges = sglang_rank_ranges()
    used = []
    for rep in reps:
        assert rep.tp_size == tp and rep.nnodes == max(1, tp // gpus_per_node)
        assert [s.node_rank for s in rep.nodes] == list(range(rep.nnodes))
        for slot in rep.nodes:
            _pp, tp_range, _ppn, tpn = rank_ranges(rep.nnodes, 1, tp, slot.node_rank)
            assert slot.tp_ranks == tuple(tp_range) and len(slot.gpu_ids) == tpn
            assert all(0 <= g < gpus_per_node for g in slot.gpu_ids)
            used += [(slot.node_index, g) for g in slot.gpu_ids]
        # the nodes of one replica are distinct; node_index grows with node_rank
        assert [s.node_index for s in rep.nodes] == sorted({s.node_index for s in rep.nodes})
    assert sorted(used) == [(n, g) for n in range(nodes) for g in range(gpus_per_node)]  # each GPU once
    ports = [p for rep in reps for p in rep.ports()]
    assert len(ports) == len(set(ports)) == len(reps) * PORTS_PER_REPLICA
    assert {rep.nccl_port for rep in reps}.isdisjoint({rep.dist_init_port for rep in reps})


def test_replicas_sharing_a_node_get_their_own_gpus_and_ports():
    reps = plan_replicas(16, 2, 8, base_port=21000)
    on_node1 = [r for r in reps if r.leader.node_index == 1]
    assert [r.leader.gpu_ids for r in on_node1] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    kwargs = [r.engine_kwargs(0) for r in on_node1]
    assert len({k["nccl_port"] for k in kwargs}) == 4 and len({k["port"] for k in kwargs}) == 4
    assert all("dist_init_addr" not in k and k["nnodes"] == 1 for k in kwargs)
    assert reps[0].port_base == 21000 and reps[5].port_base == 21000 + 5 * PORTS_PER_REPLICA


def test_a_replica_over_two_nodes_starts_each_engine_with_its_node_rank():
    rep = plan_replicas(32, 16, 8)[1]  # GPUs 16..31: nodes 2 and 3
    assert [s.node_index for s in rep.nodes] == [2, 3]
    assert [s.tp_ranks for s in rep.nodes] == [tuple(range(8)), tuple(range(8, 16))]
    lead, other = rep.engine_kwargs(0, "10.0.0.7"), rep.engine_kwargs(1, "10.0.0.7")
    assert lead["dist_init_addr"] == other["dist_init_addr"] == f"10.0.0.7:{rep.dist_init_port}"
    assert (lead["node_rank"], other["node_rank"], lead["nnodes"], lead["tp_size"]) == (0, 1, 2, 16)
    assert lead["nccl_port"] == other["nccl_port"] and lead["base_gpu_id"] == 0
    assert rep.node_env(0) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert rep.node_env(1)["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] == "0"
    assert rep.engine_kwargs(0, "fd00::7")["dist_init_addr"] == f"[fd00::7]:{rep.dist_init_port}"
    with pytest.raises(LayoutError, match="leader's IP"):
        rep.engine_kwargs(1)
    with pytest.raises(LayoutError, match="node_rank 2"):
        rep.engine_kwargs(2, "10.0.0.7")


@pytest.mark.parametrize("n_gpus,tp,gpn,match", [
    (8, 3, 8, "tp_size=3 does not divide gpus_per_node=8"),
    (24, 12, 8, "tp_size=12 > gpus_per_node=8 is not a multiple"),
    (24, 16, 8, "n_gpus=24 is not a multiple of tp_size=16"),
    (0, 1, 8, "must all be >= 1"),
    (8000, 1, 8, "pass port"),
])
def test_layouts_that_cannot_be_built_are_refused_with_the_numbers(n_gpus, tp, gpn, match):
    with pytest.raises(LayoutError, match=match):
        plan_replicas(n_gpus, tp, gpn)


def test_a_busy_block_moves_by_whole_strides_and_stays_disjoint():
    reps = plan_replicas(16, 4, 8)  # 4 replicas, stride 32
    busy = set(reps[1].ports()) | {reps[1].port_base + reps[1].port_stride + 3}
    moved = reps[1].first_free_block(lambda p: p not in busy)
    assert moved.port_base == reps[1].port_base + 2 * reps[1].port_stride
    others = [p for r in reps if r.replica_rank != 1 for p in r.first_free_block(lambda p: True).ports()]
    assert set(moved.ports()).isdisjoint(others)
    assert moved.nodes == reps[1].nodes and moved.replica_rank == 1
    with pytest.raises(LayoutError, match="no block of"):
        reps[0].first_free_block(lambda p: False)


def test_blocks_sit_below_the_ephemeral_port_range():
    reps = plan_replicas(1000, 1, 8)
    assert max(p for r in reps for p in r.ports()) <= layout.MAX_PORT < 32768
