"""The Llama-style decoder: shapes, causality, GQA, layout-independent init, pipeline splitting."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs
from isthmus.models.flavors import get_flavor
from isthmus.models.llama import Transformer, build_model, canonical_name, init_weights

TINY = get_flavor("tiny")


def make(args: ModelArgs = TINY, seed: int = 0) -> Transformer:
    model = build_model(args)
    model.to_empty(device="cpu")
    init_weights(model, seed, args)
    return model


def tokens(b: int = 2, s: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, TINY.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}


def test_forward_shape_and_no_buffers() -> None:
    model = make()
    assert model(tokens()).shape == (2, 16, TINY.vocab_size)
    # RoPE is computed from positions: nothing but parameters in the state dict.
    assert list(model.buffers()) == []
    assert set(model.state_dict()) == {n for n, _ in model.named_parameters()}


def test_causal() -> None:
    model = make()
    x = tokens()
    y = x.clone()
    y[:, 10] = (y[:, 10] + 1) % TINY.vocab_size
    a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_gqa_matches_multihead_with_repeated_kv() -> None:
    gqa = make()
    mha_args = replace(TINY, n_kv_heads=TINY.n_heads)
    mha = build_model(mha_args, device="cpu")
    rep, hd = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    state = gqa.state_dict()
    for key in list(state):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            # Query head j reads kv head j // rep: repeat each kv head's rows.
            state[key] = state[key].unflatten(0, (-1, hd)).repeat_interleave(rep, 0).flatten(0, 1)
    mha.load_state_dict(state)
    assert gqa.layers["0"].attention.wk.weight.shape == (TINY.n_kv_heads * hd, TINY.dim)
    x = tokens()
    torch.testing.assert_close(gqa(x), mha(x))


def test_gelu_path() -> None:
    args = replace(TINY, mlp="gelu", ffn_dim=4 * TINY.dim)
    model = make(args)
    ff = model.layers["0"].feed_forward
    assert ff.w3 is None and {n for n, _ in ff.named_parameters()} == {"w1.weight", "w2.weight"}
    h = torch.randn(2, 5, args.dim)
    torch.testing.assert_close(ff(h), ff.w2(F.gelu(ff.w1(h))))
    assert model(tokens()).shape == (2, 16, args.vocab_size)


def test_tied_embeddings_share_storage_after_to_empty() -> None:
    args = replace(TINY, tie_embeddings=True)
    model = make(args)
    assert model.output.weight is model.tok_embeddings.weight
    assert model.output.weight.data_ptr() == model.tok_embeddings.weight.data_ptr()
    assert len(list(model.parameters())) == len(list(make().parameters())) - 1
    # The tied matrix uses the embedding's init (std 0.02), not the head's dim**-0.5.
    assert abs(model.output.weight.std().item() - 0.02) < 0.002


def test_init_deterministic_and_seeded() -> None:
    a, b, c = params(make(seed=3)), params(make(seed=3)), params(make(seed=4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in a.items() if k.endswith("norm.weight"))
    std = 0.02 / (2 * TINY.n_layers) ** 0.5
    assert abs(a["layers.1.attention.wo.weight"].std().item() - std) < 0.1 * std


def test_init_ignores_wrappers_and_global_rng() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = make(seed=7)
    torch.manual_seed(12345)  # construction-time RNG must not matter
    wrapped = build_model(TINY, device="cpu")
    for key in list(wrapped.layers):
        wrapped.layers[key] = checkpoint_wrapper(wrapped.layers[key])
    init_weights(wrapped, 7, TINY)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    p, w = params(plain), params(wrapped)
    assert p.keys() == w.keys() and all(torch.equal(p[k], w[k]) for k in p)
    x = tokens()
    torch.testing.assert_close(plain(x), wrapped(x))


def test_canonical_name() -> None:
    assert canonical_name("_orig_mod.layers.0._checkpoint_wrapped_module.attention.wq.weight") == (
        "layers.0.attention.wq.weight"
    )
    assert canonical_name("module.norm.weight") == "norm.weight"


def test_positions_argument() -> None:
    model = make()
    x = tokens()
    s = x.shape[1]
    base = model(x)
    torch.testing.assert_close(model(x, torch.arange(s)), base)
    # RoPE is relative: shifting every position by a constant leaves logits unchanged...
    torch.testing.assert_close(model(x, torch.arange(s) + 100), base, atol=1e-4, rtol=1e-4)
    # ...while changing the gaps between positions does not.
    assert not torch.allclose(model(x, 2 * torch.arange(s)), base, atol=1e-3)


def test_replaceable_sdpa() -> None:
    model = make()
    x = tokens()
    base = model(x)
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def manual(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        calls.append((tuple(q.shape), tuple(k.shape)))
        # A kernel gets K and V grouped (grouped-query attention) and shares each among its query heads.
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v

    for layer in model.layers.values():
        layer.attention.sdpa = manual
    torch.testing.assert_close(model(x), base, atol=1e-5, rtol=1e-5)
    shapes = ((2, TINY.n_heads, 16, TINY.head_dim), (2, TINY.n_kv_heads, 16, TINY.head_dim))
    assert TINY.n_kv_heads < TINY.n_heads and calls == [shapes] * TINY.n_layers


def test_pipeline_split_matches_full() -> None:
    model = make()
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for key in ("2", "3"):
        del first.layers[key]
    for key in ("0", "1"):
        del last.layers[key]
    first.norm = first.output = None
    last.tok_embeddings = None
    x = tokens()
    hidden = first(x)
    assert hidden.shape == (2, 16, TINY.dim)
    assert list(last.layers) == ["2", "3"]
    torch.testing.assert_close(last(hidden), model(x))


def _init_sharded(seed: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    model = build_model(TINY, device="cpu")
    for block in model.layers.values():
        for lin in (block.attention.wq, block.feed_forward.w2):
            lin.weight = torch.nn.Parameter(distribute_tensor(lin.weight.detach(), mesh, [Shard(0)]))
    init_weights(model, seed, TINY)
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in model.named_parameters()}


@pytest.mark.slow
def test_dtensor_init_matches_single_process_on_two_ranks() -> None:
    from multirank import run_ranks

    want = params(make(seed=5))
    for got in run_ranks(_init_sharded, 2, 5):
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_bad_shapes_raise_config_error() -> None:
    with pytest.raises(ConfigError, match="model.n_kv_heads"):
        build_model(replace(TINY, n_kv_heads=3))
    with pytest.raises(ConfigError, match="model.n_heads"):
        build_model(replace(TINY, n_heads=5))


def test_few_steps_reduce_loss() -> None:
    torch.manual_seed(0)
    model = make()
    seq = torch.arange(33) % 11  # a short repeating pattern
    x, y = seq[:-1][None], seq[1:][None]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_norm_eps_and_rope_theta_knobs() -> None:
    from isthmus.config import build_config, parse_overrides
    from isthmus.models.resolve import resolve_model_args

    def logits(*overrides: str) -> torch.Tensor:
        cfg = build_config(None, parse_overrides(["--model.flavor", "tiny", *overrides]))
        args = resolve_model_args(cfg.model)
        with torch.no_grad():
            return make(args)(tokens())

    # Unset, the flavors keep the values the model always had: the same logits, bit for bit.
    assert resolve_model_args(build_config(None, parse_overrides([])).model).norm_eps == 1e-5
    assert resolve_model_args(build_config(None, [("model.flavor", "llama3-8b")]).model).rope_theta == 500000.0
    with torch.no_grad():
        today = make(TINY)(tokens())
    assert torch.equal(logits(), today)
    assert torch.equal(logits("--model.norm_eps", "1e-5", "--model.rope_theta", "10000"), today)
    assert not torch.allclose(logits("--model.norm_eps", "0.5"), today, atol=1e-4)
    assert not torch.allclose(logits("--model.rope_theta", "100"), today, atol=1e-4)
    with pytest.raises(ConfigError, match=r"^model\.norm_eps = 0\.0: must be positive"):
        build_config(None, parse_overrides(["--model.norm_eps", "0"]))
