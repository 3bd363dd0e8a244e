"""Mixture-of-Experts: the shape rules, the layer against a naive per-token loop, dropping and counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from isthmus.config import ModelConfig
from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs, check_args
from isthmus.models.flavors import get_flavor
from isthmus.models.flops import count_params
from isthmus.models.llama import FeedForward, build_model, init_weights
from isthmus.models.moe import MoE
from isthmus.models.resolve import resolve_model_args


def test_moe_args_properties() -> None:
    args = get_flavor("moe-small")
    assert args.is_moe and args.expert_ffn_dim == 256 and args.n_moe_layers == 4
    deep = get_flavor("deepseek-v3-like")
    assert [deep.moe_layer(i) for i in range(4)] == [False, False, False, True]
    assert deep.n_moe_layers == 58
    dense = get_flavor("small")
    assert not dense.is_moe and not dense.moe_layer(0) and dense.n_moe_layers == 0
    assert get_flavor("mixtral-8x7b").expert_ffn_dim == 14336  # moe_ffn_dim 0 = ffn_dim


@pytest.mark.parametrize(
    "override, key",
    [
        ({"top_k": 5}, "model.top_k"),
        ({"top_k": 0}, "model.top_k"),
        ({"mlp": "gelu"}, "model.mlp"),
        ({"capacity_factor": -1.0}, "model.capacity_factor"),
        ({"n_dense_layers": 4}, "model.n_dense_layers"),
        ({"router_score": "relu"}, "model.router_score"),
        ({"load_balance": "magic"}, "model.load_balance"),
        ({"n_experts": -1}, "model.n_experts"),
    ],
)
def test_moe_check_args_names_the_key(override: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        check_args(get_flavor("moe-tiny").with_overrides(**override))


def test_moe_keys_override_a_flavor() -> None:
    args = resolve_model_args(ModelConfig(flavor="tiny", n_experts=4, top_k=1, load_balance="bias"))
    assert args.is_moe and args.top_k == 1 and args.load_balance == "bias"
    # A dense flavor with MoE knobs but no experts stays dense.
    assert not resolve_model_args(ModelConfig(flavor="tiny", top_k=7)).is_moe


def _layer(flavor: str = "moe-tiny", seed: int = 0, **override: object) -> tuple[MoE, ModelArgs]:
    args = get_flavor(flavor).with_overrides(**override)
    model = build_model(args, "cpu")
    init_weights(model, seed, args)
    layer = model.layers["0"].feed_forward
    assert isinstance(layer, MoE)
    return layer, args


def _naive(layer: MoE, x: Tensor, cap: int = 0) -> Tensor:
    """Token by token: each through its top-k experts' SwiGLU, weighted; per sequence, an expert past
    ``cap`` copies (in token order) contributes nothing."""
    bsz, seqlen, dim = x.shape
    out = torch.zeros_like(x)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    for b in range(bsz):
        taken = [0] * layer.n_experts
        for s in range(seqlen):
            tok = x[b, s]
            logits = layer.router.gate.weight @ tok
            scores = logits.softmax(-1) if layer.router.score == "softmax" else logits.sigmoid()
            chosen = (scores + layer.router.expert_bias).topk(layer.top_k).indices.tolist()
            weights = scores[chosen]
            if layer.router.norm_topk:
                weights = weights / weights.sum()
            for e, w in zip(chosen, weights, strict=True):
                taken[e] += 1
                if cap and taken[e] > cap:
                    continue
                out[b, s] += w * (w2[e] @ (F.silu(w1[e] @ tok) * (w3[e] @ tok)))
            if layer.shared is not None:
                out[b, s] += layer.shared(tok)
    return out


@pytest.mark.parametrize(
    "flavor, override",
    [
        ("moe-tiny", {}),
        ("moe-small", {"n_layers": 1}),  # a shared expert
        ("moe-tiny", {"router_score": "sigmoid", "router_norm_topk": False, "top_k": 1}),
        ("moe-tiny", {"top_k": 4}),
    ],
)
def test_moe_matches_naive_per_token_loop(flavor: str, override: dict[str, object]) -> None:
    layer, args = _layer(flavor, **override)
    x = torch.randn(2, 9, args.dim, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), _naive(layer, x), rtol=1e-5, atol=1e-6)


def test_moe_gradients_match_naive_loop() -> None:
    layer, args = _layer()
    x = torch.randn(2, 7, args.dim, generator=torch.Generator().manual_seed(2))
    grads = []
    for fn in (layer, lambda t: _naive(layer, t)):
        layer.zero_grad()
        fn(x).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == {"router.gate.weight", "experts.w1", "experts.w2", "experts.w3"}
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], rtol=1e-4, atol=1e-6, msg=name)


def test_expert_bias_changes_selection_not_weights() -> None:
    layer, args = _layer(top_k=1, router_norm_topk=False)
    x = torch.randn(1, 16, args.dim, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # everyone picks expert 0
    weights, experts, scores = layer.router(x.view(-1, args.dim))
    assert experts.eq(0).all()
    torch.testing.assert_close(weights[:, 0], scores[:, 0])  # the unbiased score
    torch.testing.assert_close(layer(x), _naive(layer, x), rtol=1e-5, atol=1e-6)


def test_capacity_factor_drops_the_later_tokens() -> None:
    layer, args = _layer(capacity_factor=1.0)
    seqlen = 10
    assert layer.capacity(seqlen) == 5  # ceil(1.0 * 10 * 2 / 4)
    with torch.no_grad():
        layer.router.expert_bias.copy_(torch.tensor([10.0, 9.0, 0.0, 0.0]))  # all tokens to experts 0 and 1
    x = torch.randn(2, seqlen, args.dim, generator=torch.Generator().manual_seed(4))
    out = layer(x)
    torch.testing.assert_close(out, _naive(layer, x, cap=5), rtol=1e-5, atol=1e-6)
    assert out[:, 5:].abs().max() == 0  # tokens 5.. of each sequence found both experts full
    assert out[:, :5].abs().min(dim=-1).values.gt(0).all()
    load = layer.take_load()
    assert load is not None
    assert load.tokens.tolist() == [20.0, 20.0, 0.0, 0.0] and load.dropped.item() == 20.0 and load.forwards == 1
    assert layer.take_load() is None  # read once


def test_aux_loss_is_one_when_balanced_and_per_sequence() -> None:
    layer, args = _layer(top_k=1)
    with torch.no_grad():
        layer.router.gate.weight.zero_()  # uniform scores: P_e = 1/4
    x = torch.randn(2, 8, args.dim)
    layer(x)
    assert layer.aux_loss is not None
    # Uniform scores tie; whatever topk picks, sum_e f_e = 1, so the loss is 4 * sum_e f_e / 4 = 1.
    torch.testing.assert_close(layer.aux_loss, torch.tensor(1.0))
    # Per sequence: the batch's loss is the mean of each sequence's alone.
    layer, args = _layer()
    x = torch.randn(3, 8, args.dim, generator=torch.Generator().manual_seed(5))
    layer(x)
    whole = layer.aux_loss
    parts = []
    for b in range(3):
        layer(x[b : b + 1])
        parts.append(layer.aux_loss)
    assert whole is not None and all(p is not None for p in parts)
    torch.testing.assert_close(whole, torch.stack(parts).mean())  # type: ignore[arg-type]


def test_moe_param_counts_equal_numel() -> None:
    for name in ("moe-tiny", "moe-small"):
        args = get_flavor(name)
        model = build_model(args)
        assert sum(p.numel() for p in model.parameters()) == count_params(args)
    deep = get_flavor("deepseek-v3-like").with_overrides(dim=64, n_heads=4, n_kv_heads=4, n_layers=5, vocab_size=64)
    deep = deep.with_overrides(ffn_dim=96, moe_ffn_dim=32, n_experts=8)
    assert sum(p.numel() for p in build_model(deep).parameters()) == count_params(deep)
    assert isinstance(build_model(deep).layers["2"].feed_forward, FeedForward)
    assert isinstance(build_model(deep).layers["3"].feed_forward, MoE)


def test_moe_model_init_and_expert_bias_is_frozen_zero() -> None:
    model = build_model(get_flavor("moe-tiny"), "cpu")
    init_weights(model, 0, get_flavor("moe-tiny"))
    bias = model.layers["1"].feed_forward.router.expert_bias
    assert not bias.requires_grad and bias.abs().sum() == 0


def test_feeds_aux_grad_as_if_added_to_the_loss() -> None:
    """A pipeline stage's layer gives its aux loss the gradient itself: the same as adding it to the loss."""
    layer, args = _layer()
    x = torch.randn(2, 8, args.dim, generator=torch.Generator().manual_seed(6))
    grads = []
    for inject in (False, True):
        layer.zero_grad()
        layer.feeds_aux_grad = inject
        out = layer(x).square().sum()
        assert layer.aux_loss is not None
        (out if inject else out + layer.aux_weight * layer.aux_loss).backward()
        grads.append(layer.router.gate.weight.grad.clone())  # type: ignore[union-attr]
    torch.testing.assert_close(grads[0], grads[1])


def test_capacity_matches_naive_loop_with_random_routing() -> None:
    layer, args = _layer(capacity_factor=0.6, top_k=2)
    seqlen = 11
    cap = layer.capacity(seqlen)
    assert cap == 4  # ceil(0.6 * 11 * 2 / 4)
    x = torch.randn(3, seqlen, args.dim, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(layer(x), _naive(layer, x, cap=cap), rtol=1e-5, atol=1e-6)
    load = layer.take_load()
    assert load is not None and 0 < load.dropped.item() < 3 * seqlen * 2
