"""Mixture-of-Experts: the shape rules, the layer against a naive per-token loop, dropping and counts."""

from __future__ import annotations

import pytest

from isthmus.config import ModelConfig
from isthmus.errors import ConfigError
from isthmus.models.args import check_args
from isthmus.models.flavors import get_flavor
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
