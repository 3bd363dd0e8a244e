"""Context parallel (ring and Ulysses) against single-process attention and the full model.

Tolerance: 1e-5 absolute (and relative) in fp32. Ring computes the same sums as the
reference in a different order (per-block partial softmaxes merged by log-sum-exp),
so its errors are a few fp32 ulps of O(1) values (measured ~1e-6); Ulysses moves data
exactly and runs the same SDPA, so it matches bit for bit here. 1e-5 leaves room for
accumulation over the model's 4 layers while still catching a wrong mask, a missing
block or a scaled gradient term (a 0.1% error in dv fails it).

Ranks are spawned once per group of cases (a spawn costs seconds), and the per-case
tests read the results from module-scoped fixtures.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from isthmus.errors import ConfigError
from isthmus.models.flavors import get_flavor
from isthmus.models.llama import build_model, init_weights
from isthmus.parallel.context import (
    apply_cp,
    cp_positions,
    cp_shard,
    cp_unshard,
    make_cp_sdpa,
    ulysses_attention,
)
from multirank import run_ranks

ATOL = RTOL = 1e-5
# (impl, q heads, kv heads); kv heads < q heads is GQA handled inside the kernel.
CASES = [("ring", 4, 4), ("ring", 4, 2), ("ulysses", 4, 4), ("ulysses", 4, 2)]
CP4_CASES = [("ring", 8, 2), ("ulysses", 8, 4), ("ulysses", 8, 2)]
SEQ, BATCH, HEAD_DIM = 32, 2, 16
E2E_SEQ = 32


def make_qkv(heads: int, kv_heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen)
    k = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=gen)
    grad_out = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=gen)
    return q, k, v, grad_out


def attention_rank(cases: list[tuple[str, int, int]]) -> dict:
    """On each rank: output and q/k/v gradients of every case, for the local shard."""
    rank, size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    results = {}
    for seed, (impl, heads, kv_heads) in enumerate(cases):
        q, k, v, grad_out = (cp_shard(t, 2, rank, size) for t in make_qkv(heads, kv_heads, seed))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = make_cp_sdpa(impl, group)(q, k, v)
        out.backward(grad_out)
        results[(impl, heads, kv_heads)] = (out.detach(), q.grad, k.grad, v.grad)
    try:
        ulysses_attention(*(torch.zeros(1, 3, 4, 2) for _ in range(3)), group)
        results["bad_heads"] = None
    except ConfigError as err:
        results["bad_heads"] = err.key
    return results


def reference(heads: int, kv_heads: int, seed: int) -> tuple[torch.Tensor, ...]:
    q, k, v, grad_out = make_qkv(heads, kv_heads, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    rep = heads // kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.fixture(scope="module")
def cp2_attention() -> list[dict]:
    return run_ranks(attention_rank, 2, CASES)


@pytest.fixture(scope="module")
def cp4_attention() -> list[dict]:
    return run_ranks(attention_rank, 4, CP4_CASES)


def check_case(per_rank: list[dict], cases: list[tuple[str, int, int]], case: tuple[str, int, int]) -> None:
    expected = reference(case[1], case[2], cases.index(case))
    for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
        got = cp_unshard([r[case][i] for r in per_rank], dim=2)
        torch.testing.assert_close(got, expected[i], atol=ATOL, rtol=RTOL, msg=lambda m: f"{case} {name}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-h{c[1]}-kv{c[2]}")
def test_attention_matches_sdpa_cp2(cp2_attention: list[dict], case: tuple[str, int, int]) -> None:
    check_case(cp2_attention, CASES, case)


@pytest.mark.parametrize("case", CP4_CASES, ids=lambda c: f"{c[0]}-h{c[1]}-kv{c[2]}")
def test_attention_matches_sdpa_cp4(cp4_attention: list[dict], case: tuple[str, int, int]) -> None:
    check_case(cp4_attention, CP4_CASES, case)


def test_ulysses_rejects_heads_not_divisible(cp2_attention: list[dict]) -> None:
    assert all(r["bad_heads"] == "parallel.cp" for r in cp2_attention)


def test_unknown_impl_is_config_error() -> None:
    with pytest.raises(ConfigError, match="parallel.cp_impl"):
        make_cp_sdpa("striped", None)  # type: ignore[arg-type]


def test_shard_layout_and_round_trip() -> None:
    x = torch.arange(16).view(1, 16)
    shards = [cp_shard(x, 1, r, 4) for r in range(4)]
    assert shards[0].tolist() == [[0, 1, 14, 15]] and shards[3].tolist() == [[6, 7, 8, 9]]
    assert torch.equal(cp_unshard(shards, dim=1), x)
    assert cp_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    with pytest.raises(ConfigError, match="parallel.cp"):
        cp_shard(x, 1, 0, 3)


def make_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, get_flavor("tiny").vocab_size, (BATCH, E2E_SEQ + 1), generator=gen)
    # Labels are shifted on the full sequence, before sharding, so they shard with the inputs.
    return tokens[:, :-1], tokens[:, 1:]


def tiny_model() -> torch.nn.Module:
    args = get_flavor("tiny")
    model = build_model(args, "cpu")
    init_weights(model, 0, args)
    return model


def model_rank(impls: list[str]) -> dict:
    """Local logits and cp-summed parameter gradients of the tiny model under each impl."""
    rank, size, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    inputs, labels = make_batch()
    results = {}
    for impl in impls:
        model = tiny_model()
        apply_cp(model, group, impl)
        logits = model(cp_shard(inputs, 1, rank, size), positions=cp_positions(E2E_SEQ, rank, size))
        local_labels = cp_shard(labels, 1, rank, size)
        # Mean over this rank's tokens / cp: summing gradients over cp gives the global mean's.
        loss = F.cross_entropy(logits.flatten(0, 1), local_labels.flatten()) / size
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            dist.all_reduce(p.grad, group=group)
            grads[name] = p.grad
        results[impl] = (logits.detach(), grads)
    return results


@pytest.fixture(scope="module")
def cp2_model() -> list[dict]:
    return run_ranks(model_rank, 2, ["ring", "ulysses"])


@pytest.mark.parametrize("impl", ["ring", "ulysses"])
def test_tiny_model_logits_and_grads(cp2_model: list[dict], impl: str) -> None:
    inputs, labels = make_batch()
    model = tiny_model()
    logits = model(inputs)
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    got_logits = cp_unshard([r[impl][0] for r in cp2_model], dim=1)
    torch.testing.assert_close(got_logits, logits.detach(), atol=ATOL, rtol=RTOL)
    for name, p in model.named_parameters():
        for rank, r in enumerate(cp2_model):
            torch.testing.assert_close(
                r[impl][1][name], p.grad, atol=ATOL, rtol=RTOL, msg=lambda m: f"rank {rank} {name}: {m}"
            )
