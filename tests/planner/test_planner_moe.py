"""The planner's MoE model (issue 33): expert state divided by ep, the all-to-alls on the links the ep
group spans (the WAN priced as the WAN, and refused by the layout rule), ep in the search and its reason
in `isthmus plan`. The published MoE rows run with the dense ones (test_planner_published.py)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from isthmus.cli.main import main as isthmus_main
from isthmus.layout.rules import expert_parallel
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import get_flavor
from isthmus.planner import comm
from isthmus.planner.compute import BlockShape
from isthmus.planner.cost import block_cost, estimate, expert_all_to_all, rank_memory
from isthmus.planner.placement import place
from isthmus.planner.topology import Link, load_topology
from isthmus.planner.workload import RUNTIMES, Workload

MIXTRAL = get_flavor("mixtral-8x7b")
RT = RUNTIMES["megatron-core"]
WORK = Workload(MIXTRAL, 64, 4096, "bf16")


def _layout(ep: int, dp_shard: int = 16) -> LayoutSpec:
    return LayoutSpec(pp=4, pp_schedule="1f1b", microbatches=4, dp_shard=dp_shard, zero_stage=2, ep=ep, micro_batch=1)


def test_expert_state_is_divided_by_ep_and_the_dense_part_is_not() -> None:
    one, eight = (rank_memory(WORK, _layout(ep), RT, 0, 8) for ep in (1, 8))
    experts = 8 * MIXTRAL.n_experts * 3 * MIXTRAL.dim * MIXTRAL.expert_ffn_dim  # 8 blocks' routed experts
    # ZeRO-2: bf16 weights whole, fp32 gradients and optimizer state over the shard group. With ep 8 a rank
    # holds 1/8 of the experts' weights, sharded over dp_shard / ep = 2 instead of 16: weights fall by
    # 7/8 of the experts' bytes; gradients and optimizer state (sharded either way over 16) stay.
    assert one.weights - eight.weights == pytest.approx(2 * experts * 7 / 8, rel=1e-9)
    assert eight.optimizer == pytest.approx(one.optimizer, rel=1e-9)
    assert eight.weights > 0.05 * one.weights  # the dense part (attention, embedding) is not divided


def test_ep_adds_all_to_alls_and_waits_on_the_busiest_rank() -> None:
    topo = load_topology("eos-h100").subset(64)
    one, eight = (estimate(WORK, topo, _layout(ep), RT) for ep in (1, 8))
    assert one.breakdown["ep comm"] == 0.0 < eight.breakdown["ep comm"]
    balanced = estimate(WORK, topo, _layout(8), replace(RT, expert_imbalance=1.0))
    assert balanced.step_time_s < eight.step_time_s
    assert balanced.breakdown["ep comm"] < eight.breakdown["ep comm"]


def test_the_all_to_all_is_priced_on_the_links_its_group_spans() -> None:
    topo = load_topology("eos-h100").subset(64)
    block = BlockShape.of(WORK, _layout(8))
    in_node = place(topo, _layout(8)).sites[0]
    across = place(topo, _layout(16, dp_shard=16)).sites[0]
    assert in_node.ep is not None and in_node.ep.nodes == 1
    assert across.ep is not None and across.ep.nodes == 2
    t_node = expert_all_to_all(in_node, block, RT)
    t_fabric = expert_all_to_all(across, replace(block, ep=16), RT)
    assert t_fabric > 3 * t_node  # 45 GB/s of fabric per device against 360 GB/s of NVLink
    # An ep group over two datacenters would be priced on the WAN link: far slower again.
    wan = Link(bandwidth=1.25e9, latency=0.02, window=64e6)
    spread = replace(in_node, ep=comm.Span(8, 1, 2, in_node.ep.intra, in_node.ep.fabric, wan))
    assert expert_all_to_all(spread, replace(block, ep=16), RT) > 20 * t_fabric
    assert block_cost(in_node.dc.kind, in_node, block, "ring", RT).ep == pytest.approx(t_node)


def test_ep_across_datacenters_is_refused_naming_the_wan() -> None:
    assert expert_parallel(8, 8, 1, 8) is None
    why = expert_parallel(16, 8, 1, 16)  # 16 ranks would take in replicas beyond dp_shard x cp
    assert why is not None and why.key == "parallel.ep" and "WAN" in why
    assert expert_parallel(3, 6, 1, 8) is not None and expert_parallel(2, 2, 1, 0) is not None


def _plan(*argv: str) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert isthmus_main(["plan", *argv, "--json"]) == 0
    return json.loads(out.getvalue())


def test_plan_on_a_moe_flavor_chooses_ep_and_says_why() -> None:
    res = _plan(
        "--model.flavor", "qwen3-30b-a3b", "--topology", "eos-h100", "--gpus", "8",
        "--train.batch_size", "32", "--train.seq_len", "4096", "--top", "2",
    )  # fmt: skip
    best = res["layouts"][0]
    assert best["layout"]["ep"] > 1 and best["parallel"]["ep"] == best["layout"]["ep"]
    assert f"ep{best['layout']['ep']}" in best["label"]
    text = res["explanation"]
    assert f"Expert parallelism of {best['layout']['ep']}" in text and "The best with ep" in text
    assert "inside a datacenter" in text


@pytest.mark.parametrize(
    ("flavor", "ep", "rule"),
    [("mixtral-8x7b", "3", "must divide model.n_experts = 8"), ("llama3-8b", "2", "needs a MoE model")],
)
def test_an_ep_the_model_rules_out_is_a_one_line_error(
    flavor: str, ep: str, rule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = isthmus_main(
        [
            "simulate", "--model.flavor", flavor, "--topology", "eos-h100", "--gpus", "16",
            "--train.batch_size", "16", "--train.seq_len", "4096", "--parallel.ep", ep,
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--parallel.ep = {ep}: {rule}" in err


def test_expert_imbalance_flag_prices_the_busiest_expert() -> None:
    out = {}
    for x in ("1.0", "1.5"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = isthmus_main(
                [
                    "simulate", "--model.flavor", "mixtral-8x7b", "--topology", "eos-h100", "--gpus", "16",
                    "--train.batch_size", "16", "--train.seq_len", "4096", "--micro-batch", "1",
                    "--parallel.ep", "8", "--parallel.dp_shard", "16", "--parallel.pp", "1",
                    "--runtime", "megatron-core", "--expert-imbalance", x, "--json",
                ]
            )  # fmt: skip
        assert rc == 0
        out[x] = json.loads(buf.getvalue())
    assert out["1.5"]["step_time_s"] > out["1.0"]["step_time_s"]
    # The busiest rank receives 1.5 times the bytes (its links' latency does not grow).
    assert 1.3 < out["1.5"]["breakdown_s"]["ep comm"] / out["1.0"]["breakdown_s"]["ep comm"] < 1.5


def test_the_simulator_replays_the_all_to_alls_on_their_own_lane() -> None:
    from isthmus.sim import simulate

    topo = load_topology("eos-h100").subset(64)
    res = simulate(WORK, topo, _layout(8), RT, record=True)
    assert res.step_time_s == pytest.approx(res.planner.step_time_s, rel=0.05)
    assert res.breakdown["ep comm"] == pytest.approx(res.planner.breakdown["ep comm"], rel=0.05)
    lanes = {e.lane for e in res.trace_events if e.cat == "ep"}
    assert lanes == {"ep"}
