"""Single-process pieces of isthmus.geo: quantisation bounds, error feedback, buckets, config, accounting."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from isthmus.config import GeoConfig
from isthmus.config import validate_geo as validate
from isthmus.errors import ConfigError
from isthmus.geo import GeoGroups, accounting, compress
from isthmus.geo.buckets import build_buckets, pack_params, split_fragments, unpack_params


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_dequantised_within_half_a_step(dtype: str) -> None:
    """Every element comes back within scale / 2 = absmax / (2 qmax) of its block's absmax."""
    bs = 64
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16 * bs, generator=gen) * torch.logspace(-8, 2, 16).repeat_interleave(bs)
    x[3 * bs : 4 * bs] = 0.0  # an all-zero block
    x[5 * bs] = 1e4  # an outlier dominates its block only
    payload = compress.encode(x, dtype, bs)
    assert payload.dtype == torch.uint8 and payload.numel() == compress.payload_nbytes(x.numel(), dtype, bs)
    y = compress.decode(payload, dtype, x.numel(), bs)
    absmax = x.reshape(-1, bs).abs().amax(dim=1, keepdim=True)
    err = (y - x).reshape(-1, bs).abs()
    assert (err <= absmax / (2 * compress.QMAX[dtype]) * (1 + 1e-6)).all()
    assert (y[3 * bs : 4 * bs] == 0).all()
    # A ragged tail is one short block: no padding goes on the wire.
    tail = x[: 2 * bs + 7]
    payload = compress.encode(tail, dtype, bs)
    assert payload.numel() == compress.payload_nbytes(tail.numel(), dtype, bs)
    err = (compress.decode(payload, dtype, tail.numel(), bs) - tail)[2 * bs :].abs()
    assert (err <= tail[2 * bs :].abs().max() / (2 * compress.QMAX[dtype]) * (1 + 1e-6)).all()


def test_int4_packing_round_trips_every_code() -> None:
    codes = torch.arange(-7, 8, dtype=torch.int8).repeat(2)[:30]
    assert torch.equal(compress.unpack_int4(compress.pack_int4(codes), 30), codes)
    assert torch.equal(compress.unpack_int4(compress.pack_int4(codes[:29]), 29), codes[:29])


def test_error_feedback_sum_differs_by_last_residual_only() -> None:
    bs, gen = 32, torch.Generator().manual_seed(1)
    residual = torch.zeros(4 * bs)
    sent, true = torch.zeros(4 * bs), torch.zeros(4 * bs)
    for _ in range(10):
        x = torch.randn(4 * bs, generator=gen)
        sent += compress.decode(compress.encode_with_feedback(x, residual, "int4", bs), "int4", x.numel(), bs)
        true += x
    torch.testing.assert_close(sent + residual, true, rtol=0, atol=1e-5)


def test_buckets_pad_and_round_trip() -> None:
    params = [nn.Parameter(torch.randn(n)) for n in (5, 7, 300, 3)]
    buckets = build_buckets(params, max_numel=12, multiple=8)
    assert [b.index for b in buckets] == [[0, 1], [2], [3]]
    assert [(b.numel, b.padded) for b in buckets] == [(12, 16), (300, 304), (3, 8)]
    for b in buckets:
        buf = pack_params(params, b, torch.empty(b.padded))
        assert (buf[b.numel :] == 0).all()
        before = [p.detach().clone() for p in params]
        unpack_params(buf, params, b)
        assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_fragments_are_contiguous_balanced_and_non_empty() -> None:
    params = [nn.Parameter(torch.zeros(n)) for n in (10, 10, 10, 10, 10, 10, 10, 10)]
    assert split_fragments(params, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    lopsided = [nn.Parameter(torch.zeros(n)) for n in (1000, 1, 1, 1)]
    assert split_fragments(lopsided, 3) == [[0], [1], [2, 3]]
    assert split_fragments(lopsided, 4) == [[0], [1], [2], [3]]


@pytest.mark.parametrize(
    ("key", "value", "sync"),
    [
        ("datacenters", 0, "flat"),
        ("block_size", 255, "compressed"),
        ("inner_steps", 0, "diloco"),
        ("outer_lr", 0.0, "diloco"),
        ("outer_momentum", 1.0, "diloco"),
        ("mix_alpha", 1.0, "streaming_diloco"),
        ("fragments", 99, "streaming_diloco"),
        ("overlap_steps", 50, "streaming_diloco"),
        ("eager", True, "compressed"),
    ],
)
def test_validate_names_the_key(key: str, value: object, sync: str) -> None:
    cfg = GeoConfig(sync=sync, **{key: value})
    with pytest.raises(ConfigError, match=f"geo.{key} = "):
        validate(cfg)
    validate(GeoConfig(sync=sync))


def test_eager_refuses_fault_tolerant() -> None:
    with pytest.raises(ConfigError, match="geo.eager = True"):
        validate(GeoConfig(sync="diloco", eager=True, fault_tolerant=True))
    validate(GeoConfig(sync="streaming_diloco", eager=True))


def test_ring_tiers_of_a_two_by_two_layout() -> None:
    """Rank r of 2 datacenters x 2: in a flat ring only ranks 1 and 3 send over the WAN."""

    def groups(rank: int, per_node: int | None) -> GeoGroups:
        dc, local = divmod(rank, 2)
        no_group: Any = None  # tiers need the layout only
        return GeoGroups(no_group, no_group, no_group, dc, 2, local, 2, rank=rank, ranks_per_node=per_node)

    tiers = [accounting.link_tier(groups(r, None), accounting.ring_next(groups(r, None), "world")) for r in range(4)]
    assert tiers == ["intra_dc", "wan", "intra_dc", "wan"]
    assert accounting.link_tier(groups(0, 2), accounting.ring_next(groups(0, 2), "intra")) == "intra_node"
    for r in range(4):
        assert accounting.link_tier(groups(r, 2), accounting.ring_next(groups(r, 2), "inter")) == "wan"
    assert accounting.all_reduce_bytes(1000, 4) == 1500 and accounting.all_gather_bytes(1000, 2) == 500
    assert accounting.format_bytes(3 * 2**20) == "3.0 MiB"
