"""Pipeline parallel: the stage split, the config checks, and pp=2 training parity on gloo.

Parity: every schedule runs 3 AdamW steps on a fixed batch (8 x 32, 4 micro-batches).
Losses (and the eval loss) and first-step gradients must match the single-process
model trained on the mean loss over the whole batch, final weights the same model
accumulating the 4 micro-batches, all to 1e-5 relative. Measured: losses <= 1.1e-6,
gradients <= 7.7e-7, weights bit-identical.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from isthmus.errors import ConfigError
from isthmus.models.flavors import get_flavor
from isthmus.models.llama import build_model, canonical_name, init_weights
from isthmus.parallel.pipeline import (
    build_pipeline,
    build_stage_modules,
    check_schedule,
    partition_layers,
    pipeline_eval,
    pipeline_step,
    stage_costs,
    stage_ids_for_rank,
)
from multirank import run_ranks

BATCH, SEQ, MICRO, STEPS, RTOL = 8, 32, 4, 3, 1e-5
# (schedule, virtual stages, n_layers): the 6-layer case reaches ScheduleInterleavedZeroBubble.
Trace = tuple[list, dict[str, torch.Tensor], dict[str, torch.Tensor], "float | None"]
CASES = (("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved_1f1b", 2, 4), ("zero_bubble", 2, 4), ("zero_bubble", 3, 6))


def mean_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def reference(n_layers: int, micro: int) -> Trace:
    """Single-process AdamW on the mean loss; ``micro`` > 1 accumulates micro-batch grads / micro."""
    args = get_flavor("tiny").with_overrides(n_layers=n_layers)
    model = build_model(args, "cpu")
    init_weights(model, 0, args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    inputs, targets = batch(args.vocab_size)
    losses, grads = [], {}
    for step in range(STEPS):
        mb_losses = []
        for x, y in zip(inputs.tensor_split(micro), targets.tensor_split(micro)):
            mb_losses.append(mean_ce(model(x), y))
            mb_losses[-1].backward()
        for p in model.parameters():
            p.grad.div_(micro)  # exact: micro is a power of two
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(mb_losses).mean().item())
    with torch.no_grad():
        eval_loss = mean_ce(model(inputs), targets).item()
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss


def train_pipelined(cases: tuple) -> list[Trace]:
    """Per case: (losses or None per step, first-step grads, final params, eval loss or None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    results = []
    for schedule, virtual, n_layers in cases:
        args = get_flavor("tiny").with_overrides(n_layers=n_layers)
        sched, modules, has_first, has_last = build_pipeline(
            build_model(args), args, group, rank, world, schedule, MICRO, virtual, mean_ce, torch.device("cpu"), SEQ
        )
        named = [(canonical_name(n), p) for m in modules for n, p in m.named_parameters()]
        opt = torch.optim.AdamW([p for _, p in named], lr=1e-2, foreach=False)
        inputs, targets = batch(args.vocab_size)
        losses, grads = [], {}
        for step in range(STEPS):
            loss = pipeline_step(sched, inputs, targets, has_first, has_last)
            if step == 0:
                grads = {n: p.grad.clone() for n, p in named}
            opt.step()
            opt.zero_grad()
            losses.append(None if loss is None else loss.item())
        eval_loss = pipeline_eval(sched, inputs, targets, has_first, has_last)
        params = {n: p.detach().clone() for n, p in named}
        results.append((losses, grads, params, None if eval_loss is None else eval_loss.item()))
    return results


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def merged(per_rank: list[list[Trace]], case: int, field: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in per_rank:
        assert not out.keys() & r[case][field].keys(), "a parameter lives on two stages"
        out.update(r[case][field])
    return out


@pytest.mark.slow
def test_schedules_match_single_process() -> None:
    """Loss, grads and eval against the full-batch mean; final weights against micro-batch accumulation.

    AdamW divides by sqrt(v) + 1e-8, so a gradient element near 1e-8 moves its weight
    by up to lr whatever its rounding: full-batch vs 4 micro-batches differs by ~5e-4
    in the weights even in one process (gradients agree to ~1e-6), and the final
    weights are compared against a reference that sums micro-batches in the same order.
    """
    per_rank = run_ranks(train_pipelined, 2, CASES)
    n_layers_set = {c[2] for c in CASES}
    full = {n: reference(n, 1) for n in n_layers_set}
    accumulated = {n: reference(n, MICRO) for n in n_layers_set}
    for i, (schedule, virtual, n_layers) in enumerate(CASES):
        ref_losses, ref_grads, _, ref_eval = full[n_layers]
        losses = [next(r[i][0][s] for r in per_rank if r[i][0][s] is not None) for s in range(STEPS)]
        eval_loss = next(r[i][3] for r in per_rank if r[i][3] is not None)
        grads, params = merged(per_rank, i, 1), merged(per_rank, i, 2)
        ref_params = accumulated[n_layers][2]
        assert grads.keys() == params.keys() == ref_params.keys()
        errors = (
            max(abs(a - b) / abs(b) for a, b in zip(losses + [eval_loss], ref_losses + [ref_eval])),
            max(rel_err(grads[n], ref_grads[n]) for n in ref_grads),
            max(rel_err(params[n], ref_params[n]) for n in ref_params),
        )
        assert max(errors) < RTOL, (schedule, virtual, errors)


def test_partition_balanced_and_complete() -> None:
    args = get_flavor("tiny")
    assert partition_layers(args, 2, SEQ) == [(0, 2), (2, 4)]
    assert partition_layers(args, 4, SEQ) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    big = get_flavor("llama3-8b").with_overrides(n_layers=12)
    block, embed, head = stage_costs(big, 4096)
    assert head > 2 * block  # a vocab of 128k makes the head worth two blocks

    def max_cost(ranges: list[tuple[int, int]]) -> int:
        return max((e - s) * block + embed * (s == 0) + head * (e == big.n_layers) for s, e in ranges)

    for n_stages in (1, 3, 4, 12):
        ranges = partition_layers(big, n_stages, 4096)
        assert ranges[0][0] == 0 and ranges[-1][1] == big.n_layers and len(ranges) == n_stages
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(s < e for s, e in ranges)
        # Optimal: no other contiguous split has a cheaper costliest stage.
        cuts = itertools.combinations(range(1, big.n_layers), n_stages - 1)
        brute = min(max_cost(list(zip((0, *c), (*c, big.n_layers)))) for c in cuts)
        assert max_cost(ranges) == brute
        assert ranges == partition_layers(big, n_stages, 4096)
    assert partition_layers(big, 4, 4096)[-1] == (11, 12)
    with pytest.raises(ConfigError, match="parallel.pp = 5"):
        partition_layers(args, 5, SEQ)


def test_stage_modules_and_placement() -> None:
    args = get_flavor("tiny")
    ranges = partition_layers(args, 4, SEQ)
    first, last = build_stage_modules(build_model(args), args, ranges, [0, 3])
    assert list(first.layers) == ["0"] and first.norm is None and first.output is None
    assert list(last.layers) == ["3"] and last.tok_embeddings is None and last.output is not None
    assert stage_ids_for_rank(1, 2, 2, "zero_bubble") == [1, 2]
    assert stage_ids_for_rank(1, 2, 2, "interleaved_1f1b") == [1, 3]
    assert stage_ids_for_rank(0, 2, 3, "zero_bubble") == [0, 2, 4]
    tied = args.with_overrides(tie_embeddings=True)
    with pytest.raises(ConfigError, match="model.tie_embeddings"):
        build_stage_modules(build_model(tied), tied, ranges, [0])


@pytest.mark.parametrize(
    ("schedule", "pp", "micro", "virtual", "key"),
    [
        ("pipedream", 2, 4, 1, "parallel.pp_schedule"),
        ("gpipe", 2, 4, 2, "parallel.pp_virtual_stages"),
        ("1f1b", 2, 4, 2, "parallel.pp_virtual_stages"),
        ("interleaved_1f1b", 2, 4, 1, "parallel.pp_virtual_stages"),
        ("zero_bubble", 2, 4, 1, "parallel.pp_virtual_stages"),
        ("1f1b", 4, 3, 1, "parallel.microbatches"),
        ("interleaved_1f1b", 4, 10 + 1, 2, "parallel.microbatches"),
        ("gpipe", 2, 0, 1, "parallel.microbatches"),
    ],
)
def test_schedule_config_errors(schedule: str, pp: int, micro: int, virtual: int, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        check_schedule(schedule, pp, micro, virtual)


def test_schedule_config_accepted() -> None:
    check_schedule("gpipe", 4, 1, 1)
    check_schedule("interleaved_1f1b", 4, 3, 2)  # one round of 3: torch's flexible interleaving
    check_schedule("zero_bubble", 4, 1, 2)
