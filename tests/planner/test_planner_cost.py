"""Cost-model pieces against hand arithmetic: FLOPs, GEMM curve, collectives, pipelines, memory."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor, gpt3
from isthmus.models.flops import forward_flops_per_token, layer_matmul_params
from isthmus.models.llama import TransformerBlock, rope_cos_sin
from isthmus.planner import comm
from isthmus.planner.autoplan import local_runtime
from isthmus.planner.compute import BlockShape, gemm_fraction, gemm_time, head_ops, layer_ops
from isthmus.planner.cost import estimate
from isthmus.planner.geo import cross_dc_all_reduce
from isthmus.planner.memory import (
    autocast_weight_copy_bytes,
    layer_activation_bytes,
    layer_input_bytes,
    model_state_bytes,
)
from isthmus.planner.pipeline import in_flight, partition_layers, pipeline_time
from isthmus.planner.topology import Link, device_kinds, load_topology, parse_topology
from isthmus.planner.workload import RUNTIMES, Workload

A100 = device_kinds()["a100-80g"]
MEG, ISTH = RUNTIMES["megatron-2021"], RUNTIMES["isthmus"]


@pytest.mark.parametrize("flavor, runtime", [("gpt3-1.7b", MEG), ("llama3-8b", ISTH)])
@pytest.mark.parametrize("tp", [1, 8])
def test_op_flops_add_up_to_exact_model_flops(flavor: str, runtime: object, tp: int) -> None:
    args, b, s = get_flavor(flavor), 2, 2048
    ops = layer_ops(A100, BlockShape(args, b, s, tp), runtime) * args.n_layers  # type: ignore[arg-type]
    ops += head_ops(A100, BlockShape(args, b, s, tp))
    fwd = sum(op.flops for op in ops if op.phase == "fwd") * tp
    assert fwd == pytest.approx(forward_flops_per_token(args, s) * b * s, rel=1e-12)
    if runtime is MEG:  # every GEMM's two backward GEMMs have its FLOPs
        assert sum(op.flops for op in ops if op.phase != "fwd") == pytest.approx(2 * fwd / tp, rel=1e-12)


def test_gemm_curve_saturates_in_each_dimension() -> None:
    big = 1e9
    assert gemm_fraction(A100, big, big, big) == pytest.approx(A100.gemm_max_fraction, rel=1e-6)
    d0 = A100.gemm_half_dim
    assert gemm_fraction(A100, d0, big, big) == pytest.approx(A100.gemm_max_fraction / 2, rel=1e-6)
    sizes = [64, 256, 1024, 8192]
    fracs = [gemm_fraction(A100, 4096, 4096, k) for k in sizes]
    assert fracs == sorted(fracs)
    # A skinny GEMM is memory-bound: its time follows bytes, not FLOPs.
    t = gemm_time(A100, "bf16", 16384, 16384, 1)
    assert t == pytest.approx(
        A100.kernel_launch_s + 2 * (16384 * 16384 + 2 * 16384) / (A100.memory_bandwidth * A100.memory_bw_fraction)
    )


def test_collectives_alpha_beta() -> None:
    nv, ib, wan = Link(200e9, 2e-6), Link(25e9, 5e-6), Link(10e9, 10e-3)
    node = comm.Span(8, 1, 1, nv, ib)
    b = 1e9
    assert comm.all_reduce(b, node) == pytest.approx(2 * (7 * 2e-6 + 7 / 8 * b / 200e9))
    four = comm.Span(8, 4, 1, nv, ib)
    rs = 7 * 2e-6 + 7 / 8 * b / 200e9 + 3 * 5e-6 + 3 / 4 * (b / 8) / 25e9
    assert comm.reduce_scatter(b, four) == pytest.approx(rs)
    assert comm.all_gather(b, four) == pytest.approx(rs)
    geo = comm.Span(1, 1, 3, nv, ib, wan, concurrent=4)  # 4 groups share the WAN link
    assert comm.all_reduce(b, geo) == pytest.approx(2 * (2 * 10e-3 + 2 / 3 * b * 4 / 10e9))
    ring = comm.all_reduce(b, comm.Span(8, 4, 3, nv, ib, wan), "ring")
    assert ring == pytest.approx(2 * 95 * (10e-3 + b / 96 / 10e9))  # each step waits for the WAN
    assert comm.wan_bytes_all_reduce(b, geo) == pytest.approx(4 * b)
    assert comm.p2p(b, ib, share=2) == pytest.approx(5e-6 + 2 * b / 25e9)
    assert comm.all_to_all(b, node) == pytest.approx(7 * 2e-6 + 7 / 8 * b / 200e9)


def test_cross_dc_strategies_trade_bytes_for_quality() -> None:
    span = comm.Span(4, 2, 3, Link(200e9, 2e-6), Link(25e9, 5e-6), Link(10e9, 10e-3), concurrent=2)
    b = 4e9
    times = {}
    for geo in ("flat", "hierarchical", "compressed", "diloco"):
        times[geo] = cross_dc_all_reduce(
            b, span, LayoutSpec(datacenters=3, dc_axis="dp", sync=geo, inner_steps=50), ISTH
        )  # type: ignore[arg-type]
    assert times["compressed"][2] == pytest.approx(ISTH.compress_ratio * times["hierarchical"][2])
    assert times["diloco"][2] == pytest.approx(times["hierarchical"][2] / 50)  # fp32 deltas, 1/H of the steps
    assert times["flat"][0] > times["hierarchical"][0] > times["compressed"][0] > times["diloco"][0]


def test_pipeline_schedules() -> None:
    p, m, s = 8, 32, 1.0
    t, idle = pipeline_time([s] * p, [s / 3] * p, m, 1, "1f1b")
    assert t == pytest.approx((m + p - 1) * s) and idle == pytest.approx((p - 1) * s)
    t2, _ = pipeline_time([s] * p, [s / 3] * p, m, 4, "interleaved_1f1b")
    assert t2 == pytest.approx((m + (p - 1) / 4) * s)
    t3, _ = pipeline_time([s] * p, [s / 3] * p, m, 2, "zero_bubble")
    assert t3 == pytest.approx((m + (p - 1) * (1 / 3) / 2) * s) and t3 < t2
    slow, _ = pipeline_time([s] * (p - 1) + [2 * s], [0.0] * p, m, 1, "1f1b")
    assert slow == pytest.approx(m * 2 * s + (p - 1) * s)  # the slowest stage paces the steady state
    assert in_flight("1f1b", p, 1, m) == p and in_flight("gpipe", p, 1, m) == m
    assert in_flight("interleaved_1f1b", p, 4, m) == pytest.approx(p + (p - 1) / 4)
    assert in_flight("1f1b", p, 1, m, rank=p - 1) == 1 and in_flight("1f1b", 1, 1, m) == 1


def test_uneven_partition_for_mixed_speeds() -> None:
    assert partition_layers(12, [2.0, 1.0], [0.0, 0.0]) == [4, 8]  # rank 1 twice as fast
    assert partition_layers(12, [1.0, 1.0, 1.0], [0.0, 0.0, 3.0]) == [5, 5, 2]  # the head costs 3 layers


def test_korthikanti_activation_formulas_exact() -> None:
    args = gpt3(96, 12288, 96)
    s, b, h, a = 2048, 1, 12288, 96
    sbh = s * b * h
    assert layer_activation_bytes(BlockShape(args, b, s, 1, 1, False), MEG) == pytest.approx(sbh * (34 + 5 * a * s / h))
    for t in (2, 8):
        assert layer_activation_bytes(BlockShape(args, b, s, t, 1, False), MEG) == pytest.approx(
            sbh * (10 + 24 / t + 5 * a * s / (h * t))
        )
        assert layer_activation_bytes(BlockShape(args, b, s, t, 1, True), MEG) == pytest.approx(
            sbh * (34 / t + 5 * a * s / (h * t))
        )
    assert layer_input_bytes(BlockShape(args, b, s, 8, 1, False)) == 2 * sbh
    # Fused attention and no dropout drop the 5as/h term and the masks.
    assert layer_activation_bytes(BlockShape(args, b, s, 1, 1, False), RUNTIMES["torchtitan"]) == pytest.approx(
        sbh * 32
    )
    # isthmus's block on CPU ranks (fp32) keeps the same tensors at twice the width: its RMSNorm keeps
    # the input and rsqrt alone (the rsqrt per token, not counted), as the fused kernels do.
    assert layer_activation_bytes(BlockShape(args, b, s, 1, 1, False, dtype="fp32"), local_runtime()) == pytest.approx(
        sbh * 64
    )


@pytest.mark.parametrize("precision", ["fp32", "autocast-bf16", "fsdp-bf16"])
def test_a_block_keeps_what_the_runtime_counts(precision: str) -> None:
    """Every tensor autograd saves in one real `small` block (GQA: 4 query heads, 2 KV heads), each
    storage once and parameters left out, is exactly what isthmus's accounting says: the CPU
    runtime's in fp32; under bf16 autocast over fp32 weights (isthmus's mixed precision where no
    FSDP, CPU or GPU) the activations and the bf16 copies of the block's weights; under FSDP2's
    mixed precision (bf16 weights and inputs) the activations, each norm's fp32 input among them."""
    args = replace(get_flavor("small"), vocab_size=256)
    block = TransformerBlock(args)
    b, s = 4, 64
    x = torch.randn(b, s, args.dim, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(s), args.head_dim, args.rope_theta)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # cos / sin and the norms' per-token rsqrt are not per-block activations of the hidden size
        if storage.data_ptr() not in params and t.numel() >= b * s * args.n_kv_heads * args.head_dim:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    autocast = precision == "autocast-bf16"
    if precision == "fsdp-bf16":  # what FSDP2's mixed precision computes with: bf16 weights and input
        block = block.to(torch.bfloat16)
        x = x.detach().to(torch.bfloat16).requires_grad_()
        params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
    ):
        block(x, cos, sin)
    if precision == "fsdp-bf16":
        planned = layer_activation_bytes(
            BlockShape(args, b, s, 1, 1, False, dtype="bf16"), RUNTIMES["isthmus"], fsdp=True
        )
    elif autocast:
        rt = RUNTIMES["isthmus"]
        planned = layer_activation_bytes(BlockShape(args, b, s, 1, 1, False), rt)
        planned += autocast_weight_copy_bytes(args, 1, False, 1, rt, "bf16")
    else:
        planned = layer_activation_bytes(BlockShape(args, b, s, 1, 1, False, dtype="fp32"), local_runtime())
    assert sum(kept.values()) == planned


def test_autocast_holds_every_weight_copy_for_the_step_even_when_recomputed() -> None:
    """Under bf16 autocast the cast cache keeps a bf16 copy of each weight until the region ends, so
    a forward through four fully recomputed `small` blocks (whose activations go) still holds all
    four blocks' copies: what the isthmus runtime counts once per rank (torch.profiler's memory
    events, as benchmarks/peak_memory.py measures a step)."""
    from torch.utils.checkpoint import checkpoint

    sys.path.append(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from peak_memory import step_peak_bytes  # the benchmark's measure, not a second one

    args = replace(get_flavor("small"), vocab_size=256)
    blocks = [TransformerBlock(args) for _ in range(4)]
    s = 8
    x = torch.randn(1, s, args.dim, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(s), args.head_dim, args.rope_theta)
    kept: list[torch.Tensor] = []

    def forward() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for block in blocks:
                h = checkpoint(block, h, cos, sin, use_reentrant=False)
            kept.append(h)

    copies = autocast_weight_copy_bytes(args, 4, False, 1, RUNTIMES["isthmus"], "bf16")
    assert copies == 4 * 2 * layer_matmul_params(args)
    assert step_peak_bytes(forward) == pytest.approx(copies, rel=0.05)


def test_zero_stages_shard_state() -> None:
    n, p = 8, 1e9
    assert model_state_bytes(p, 1, 1, MEG) == (2 * p, 2 * p, 12 * p)
    assert sum(model_state_bytes(p, 1, n, MEG)) == pytest.approx(4 * p + 12 * p / n)
    assert sum(model_state_bytes(p, 2, n, MEG)) == pytest.approx(2 * p + 2 * p / n + 14 * p / n)
    assert sum(model_state_bytes(p, 3, n, MEG)) == pytest.approx(16 * p / n)
    assert model_state_bytes(p, 3, n, MEG, accumulate=True)[1] == 2 * p  # FSDP accumulates unsharded


def test_estimate_reports_memory_that_does_not_fit() -> None:
    topo = load_topology("selene-a100").subset(8)
    work = Workload(get_flavor("gpt3-145.6b"), 8, 2048)
    est = estimate(
        work,
        topo,
        LayoutSpec(tp=8, sequence_parallel=True, micro_batch=1, grad_accum=8, activation_checkpoint="full"),
        ISTH,
    )
    assert not est.fits and est.mem_per_device_gb > 80
    small = estimate(
        Workload(get_flavor("gpt3-1.7b"), 64, 2048),
        topo,
        LayoutSpec(dp_replicate=8, micro_batch=1, grad_accum=8, activation_checkpoint="full"),
        ISTH,
    )
    assert small.fits and 0.2 < small.mfu < 0.8 and small.bubble_fraction == 0 and small.wan_bytes_per_step == 0
    assert set(small.as_json()) >= {
        "layout",
        "step_time_s",
        "tokens_per_s",
        "tflops_per_device",
        "mfu",
        "mem_per_device_gb",
        "bubble_fraction",
        "wan_bytes_per_step",
    }


def test_mixed_device_kinds_get_uneven_stages() -> None:
    def dc(name: str, device: str) -> dict:
        return {
            "name": name,
            "device": device,
            "nodes": 16,
            "devices_per_node": 8,
            "intra_node": {"bandwidth_gb_s": 300, "latency_us": 3},
            "fabric": {"bandwidth_gb_s": 25, "latency_us": 6},
        }

    topo = parse_topology(
        {
            "name": "mixed",
            "datacenters": [dc("old", "a100-80g"), dc("new", "h100-sxm")],
            "wan": [{"between": ["old", "new"], "bandwidth_gb_s": 50, "latency_us": 5000}],
        }
    )
    lay = LayoutSpec(
        tp=8,
        sequence_parallel=True,
        pp=4,
        dp_replicate=8,
        micro_batch=1,
        microbatches=32,
        activation_checkpoint="full",
        datacenters=2,
        dc_axis="pp",
    )
    est = estimate(Workload(get_flavor("gpt3-39.1b"), 256, 2048), topo, lay, ISTH)
    a100, h100 = est.stage_layers[:2], est.stage_layers[2:]
    assert sum(est.stage_layers) == 48 and max(a100) < min(h100)
    assert est.wan_bytes_per_step == pytest.approx(2 * 256 * 2048 * 8192 * 2)  # one cut, activations both ways
