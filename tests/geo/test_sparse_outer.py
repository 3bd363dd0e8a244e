"""Sparse 2-bit outer gradients (geo.outer_dtype = "topk2"): the codec alone, then streaming DiLoCo with it."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from isthmus.config import GeoConfig, resolved_outer_dtype
from isthmus.config import validate_geo as validate
from isthmus.errors import ConfigError
from isthmus.geo import build_geo_groups, build_geo_sync, compress, sparse
from isthmus.layout import wire
from multirank import run_ranks

BS, K = 256, wire.topk2_chunk_k(256, 0.02)


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.logspace(-6, 1, n // BS + 1).repeat_interleave(BS)[:n]


def test_top_k_of_x_plus_residual_is_what_is_sent() -> None:
    x, residual = _vector(8 * BS), _vector(8 * BS, seed=1) * 0.5
    target = x + residual
    sent = sparse.decode(sparse.encode_with_feedback(x, residual, BS, K), x.numel(), BS, K)
    for c in range(8):
        chunk = slice(c * BS, (c + 1) * BS)
        expected = set(target[chunk].abs().topk(K).indices.tolist())
        assert set(sent[chunk].nonzero().flatten().tolist()) == expected


def test_two_bits_decode_to_the_signs_and_two_levels_per_chunk() -> None:
    x = _vector(6 * BS + 37)  # a ragged last chunk
    payload = sparse.encode(x, BS, K)
    y = sparse.decode(payload, x.numel(), BS, K)
    for c in range(7):
        chunk = slice(c * BS, min((c + 1) * BS, x.numel()))
        nz = y[chunk].nonzero().flatten()
        assert (y[chunk][nz].sign() == x[chunk][nz].sign()).all()
        picked = x[chunk][nz].abs()
        levels = y[chunk][nz].abs().unique()
        assert len(levels) <= 2 and picked.min() * 0.99 <= levels.min() and levels.max() <= picked.max() * 1.01
    # Equal magnitudes come back exactly (bf16-representable levels).
    same = torch.tensor([1.5, -1.5] * (BS // 2))
    assert torch.equal(sparse.decode(sparse.encode(same, BS, K), BS, BS, K).abs().unique(), torch.tensor([0.0, 1.5]))


def test_error_feedback_keeps_what_was_not_sent() -> None:
    """sent + new residual == x + old residual: exactly where nothing was sent, to rounding elsewhere."""
    x, residual = _vector(4 * BS + 100), _vector(4 * BS + 100, seed=2)
    target = x + residual
    sent = sparse.decode(sparse.encode_with_feedback(x, residual, BS, K), x.numel(), BS, K)
    unsent = sent == 0
    assert torch.equal(residual[unsent], target[unsent])
    torch.testing.assert_close(sent + residual, target, rtol=0, atol=1e-6 * target.abs().max().item())
    # Over many steps the running sum of what was sent tracks the sum of the true values.
    residual, total_sent, total = torch.zeros(BS * 4), torch.zeros(BS * 4), torch.zeros(BS * 4)
    for t in range(200):
        g = _vector(BS * 4, seed=10 + t)
        total += g
        total_sent += sparse.decode(sparse.encode_with_feedback(g, residual, BS, K), g.numel(), BS, K)
    torch.testing.assert_close(total_sent + residual, total, rtol=0, atol=1e-4)


@pytest.mark.parametrize("bs", [256, 4096])
def test_at_two_percent_it_sends_over_ten_times_fewer_bytes_than_int4(bs: int) -> None:
    n, k = 64 * bs + 5, wire.topk2_chunk_k(bs, 0.02)
    x = _vector(n)
    assert sparse.encode(x, bs, k).numel() == wire.topk2_payload_nbytes(n, bs, k)
    ratio = compress.payload_nbytes(n, "int4", bs) / wire.topk2_payload_nbytes(n, bs, k)
    assert ratio >= 10, ratio  # 256: 12.9x (1-byte offsets, k = 5); 4096: 10.9x (2-byte offsets, k = 82)


def test_two_byte_offsets_round_trip() -> None:
    bs = 1024
    x = torch.zeros(3 * bs)
    x[[5, 300, 1023, bs + 700, 2 * bs + 1000]] = torch.tensor([2.0, -2.0, 2.0, -3.0, 4.0])
    y = sparse.decode(sparse.encode(x, bs, 3), x.numel(), bs, 3)
    assert torch.equal(y.nonzero().flatten(), x.nonzero().flatten())


def test_config() -> None:
    assert GeoConfig().outer_dtype == "auto" and resolved_outer_dtype(GeoConfig(sync="streaming_diloco")) == "int4"
    validate(GeoConfig(sync="streaming_diloco", outer_dtype="topk2"))
    for bad, key in (
        ({"outer_density": 0.0}, "geo.outer_density"),
        ({"outer_density": 1.5}, "geo.outer_density"),
        ({"block_size": 2**17}, "geo.block_size"),
    ):
        with pytest.raises(ConfigError, match=key):
            validate(GeoConfig(sync="streaming_diloco", outer_dtype="topk2", **bad))


# -- 2 datacenters x 1 rank: streaming DiLoCo with topk2 trains, sends little, resumes exactly -----------


def _tiny() -> tuple[nn.Module, list[nn.Parameter]]:
    from isthmus.models.flavors import get_flavor
    from isthmus.models.llama import build_model, init_weights

    args = get_flavor("tiny")
    model = build_model(args, "cpu")
    init_weights(model, 0, args)
    return model, list(model.parameters())


def _streaming(outer_dtype: str, steps: int = 24, checkpoint_at: int | None = 9, **geo: Any) -> dict[str, Any]:
    """H = 8, 4 fragments, tau = 1; each rank fits its own fixed batch (so the loss must fall)."""
    groups, rank = build_geo_groups(2, 1), dist.get_rank()
    cfg = GeoConfig(
        sync="streaming_diloco", inner_steps=8, fragments=4, overlap_steps=1, outer_dtype=outer_dtype, **geo
    )
    tokens = torch.randint(0, 256, (4, 17), generator=torch.Generator().manual_seed(rank))

    def build() -> tuple[nn.Module, list[nn.Parameter], Any, Any]:
        model, params = _tiny()
        opt = torch.optim.AdamW(params, lr=3e-3, foreach=False)
        return model, params, opt, build_geo_sync(cfg.sync, groups, params, cfg)

    def train(model: nn.Module, params: list, opt: Any, sync: Any, steps_: range, out: dict) -> None:
        for step in steps_:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            sync.reduce_gradients(params)
            opt.step()
            sync.after_optimizer_step(step, params)
            out["loss"].append(loss.item())
            if step == checkpoint_at:
                assert sync.pending  # a transfer in flight goes into the checkpoint
                buf = io.BytesIO()
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "geo": sync.state_dict()}, buf)
                out["ckpt"] = buf.getvalue()
        sync.finish(params)

    model, params, opt, sync = build()
    out: dict[str, Any] = {"loss": []}
    train(model, params, opt, sync, range(steps), out)
    out["final"] = torch.cat([p.detach().reshape(-1) for p in params])
    out["wan"] = sync.bytes_sent["wan"]
    if checkpoint_at is not None:
        model2, params2, opt2, sync2 = build()
        state = torch.load(io.BytesIO(out.pop("ckpt")))
        model2.load_state_dict(state["model"])
        opt2.load_state_dict(state["opt"])
        sync2.load_state_dict(state["geo"])
        train(model2, params2, opt2, sync2, range(checkpoint_at + 1, steps), {"loss": []})
        out["resumed_final"] = torch.cat([p.detach().reshape(-1) for p in params2])
    return out


def _run() -> dict[str, Any]:
    return {
        "topk2": _streaming("topk2"),
        "int4": _streaming("int4", checkpoint_at=None),
        "topk2_decay": _streaming("topk2", checkpoint_at=None, feedback_decay=0.95),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_ranks(_run, 2)


@pytest.mark.slow
def test_streaming_topk2_trains_and_sends_ten_times_fewer_bytes_than_int4(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        for name in ("topk2", "topk2_decay"):
            assert r[name]["loss"][-1] < 0.7 * r[name]["loss"][0]
        assert r["int4"]["wan"] >= 10 * r["topk2"]["wan"] > 0
        # geo.feedback_decay reaches the codec: the same bytes, other values.
        assert r["topk2_decay"]["wan"] == r["topk2"]["wan"]
        assert not torch.equal(r["topk2_decay"]["final"], r["topk2"]["final"])


@pytest.mark.slow
def test_streaming_topk2_resumes_exactly(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        assert torch.equal(r["topk2"]["resumed_final"], r["topk2"]["final"])
