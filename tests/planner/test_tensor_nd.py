"""2D / 2.5D / 3D tensor parallelism priced beside 1D + SP + CP (isthmus.planner.tensor_nd)."""

from __future__ import annotations

import pytest

from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs
from isthmus.models.flavors import FLAVORS
from isthmus.planner.tensor_nd import BlockPrice, Grid, block_linears, collectives, grids, price
from isthmus.planner.topology import load_topology
from isthmus.planner.workload import RUNTIMES

SMALL = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=256)
B, S, E = 8, 32, 2  # sequences, tokens each, bf16 bytes
M = B * S


def volume(grid: Grid, ops: tuple[str, ...], phases: tuple[str, ...] = ("fwd", "bwd")) -> float:
    sizes = {name: size for name, (size, _) in grid.axes().items()}
    return sum(c.volume(sizes[c.axis]) for c in collectives(grid, SMALL, B, S) if c.op in ops and c.phase in phases)


def test_linears_are_the_block_matmuls() -> None:
    # qkv 64 -> 64 + 2 * 32, proj 64 -> 64, SwiGLU's gate and up fused 64 -> 192, down 96 -> 64.
    assert [(lin.k, lin.n) for lin in block_linears(SMALL)] == [(64, 128), (64, 64), (64, 192), (96, 64)]


def test_1d_moves_four_gathers_and_four_scatters_of_the_hidden_states() -> None:
    p = 4
    assert volume(Grid("1d", p, p), ("all_gather", "reduce_scatter")) == pytest.approx(8 * (p - 1) / p * M * 64 * E)


def test_2d_summa_broadcasts_and_reduces_per_linear() -> None:
    q = 2
    grid = Grid("2d", q * q, q)
    # Forward: q broadcasts of an X block along the row and of a W block down the column; backward
    # twice that (dX: W broadcast, dX reduced; dW: X broadcast, dW reduced): 3 (q-1) (MK + KN) e / q^2.
    want = sum(3 * (q - 1) * (M * lin.k + lin.k * lin.n) * E / q**2 for lin in block_linears(SMALL))
    assert volume(grid, ("broadcast", "reduce")) == pytest.approx(want)
    fwd = [c for c in collectives(grid, SMALL, B, S) if c.phase == "fwd" and c.op == "broadcast"]
    assert {(c.axis, c.count) for c in fwd} == {("row", q), ("col", q)}
    qkv = block_linears(SMALL)[0]
    assert fwd[0].nbytes == M / q * qkv.k / q * E and fwd[1].nbytes == qkv.k / q * qkv.n / q * E


def test_2p5d_is_summa_on_a_depth_slice_plus_a_gradient_sum_over_depth() -> None:
    q, d = 2, 2
    grid = Grid("2.5d", q * q * d, q, d)
    lins = block_linears(SMALL)
    want = sum(3 * (q - 1) * (M / d * lin.k + lin.k * lin.n) * E / q**2 for lin in lins)
    assert volume(grid, ("broadcast", "reduce")) == pytest.approx(want)
    step = sum(2 * (d - 1) / d * lin.k * lin.n * E / q**2 for lin in lins)
    assert volume(grid, ("all_reduce",), ("step",)) == pytest.approx(step)


def test_3d_gathers_input_and_weight_and_scatters_output() -> None:
    q = 2
    grid = Grid("3d", q**3, q)
    want = sum(2 * (q - 1) * (M * lin.k + lin.k * lin.n + M * lin.n) * E / q**3 for lin in block_linears(SMALL))
    assert volume(grid, ("all_gather", "reduce_scatter")) == pytest.approx(want)


def test_grids_and_batch_split() -> None:
    labels = {g.label for g in grids(64, 8)}
    assert {"tp 64", "tp 8 cp 8", "8x8", "4x4x4", "2x2x16"} <= labels and "4x4x4" in labels
    assert not any(g.scheme == "2d" for g in grids(8, 8))
    with pytest.raises(ConfigError, match="multiple"):
        collectives(Grid("3d", 64, 4), SMALL, 8, S)  # 3D splits the sequences 16 ways


def _prices(topology: str, devices: int, dcs: int = 1) -> dict[str, BlockPrice]:
    topo = load_topology(topology)
    dc = topo.datacenters[0]
    wan = topo.wan_link(dc.name, topo.datacenters[1].name) if dcs > 1 else None
    args, runtime = FLAVORS["llama3-70b"], RUNTIMES["megatron-core"]
    out = {}
    for g in grids(devices, dc.devices_per_node):
        if 16 % g.batch_split == 0:
            out[g.label] = price(g, args, 16, 8192, dc, runtime, dcs=dcs, wan=wan)
    return out


def test_inside_a_node_1d_communicates_faster_than_2d() -> None:
    r = _prices("eos-h100", 4)
    assert r["tp 4"].comm_s < r["2x2"].comm_s


def test_across_nodes_2d_and_3d_move_less_than_1d_but_1d_with_cp_is_faster() -> None:
    r = _prices("eos-h100", 64)
    one, two, three, cp = r["tp 64"], r["8x8"], r["4x4x4"], r["tp 8 cp 8"]
    assert two.comm_bytes < one.comm_bytes / 2 and three.comm_bytes < one.comm_bytes / 2
    assert two.step_s < one.step_s
    assert cp.step_s < min(two.step_s, three.step_s)
    # Every scheme computes the same FLOPs per device; their GEMM shapes differ (tp 64 splits a
    # dimension 64 ways, an 8 x 8 grid two dimensions 8 ways), which an H100's curve prices apart.
    assert two.compute_s == pytest.approx(one.compute_s, rel=0.2)


def test_a_grid_over_the_wan_pays_for_it() -> None:
    here, there = _prices("geo-3dc-h100", 16), _prices("geo-3dc-h100", 16, dcs=2)
    assert there["4x4"].comm_s > 5 * here["4x4"].comm_s
