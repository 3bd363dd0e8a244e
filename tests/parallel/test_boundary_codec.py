"""The pipeline boundary codecs (``geo.pp_compression``): round trips, int4 packing, wire sizes."""

from __future__ import annotations

import pytest
import torch

from isthmus.layout.choices import PP_COMPRESSIONS as METHODS
from isthmus.layout.wire import encode_flops, wire_bytes
from isthmus.parallel.boundary_codec import BoundaryCodec, _pack_int4, _unpack_int4


def _round_trip(codec: BoundaryCodec, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    codec.decode(codec.encode(x), out)
    return out


@pytest.mark.parametrize("method,bits", [("int8", 8), ("int4", 4)])
def test_quantisation_error_is_within_half_a_step_per_token(method: str, bits: int) -> None:
    x = torch.randn(3, 40, 96) * torch.logspace(-3, 2, 40).view(1, 40, 1)  # tokens of very different size
    out = _round_trip(BoundaryCodec(method), x)
    step = x.abs().amax(dim=-1, keepdim=True) / (2 ** (bits - 1) - 1)
    assert ((out - x).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all()
    zero = torch.zeros(2, 8)
    assert torch.equal(_round_trip(BoundaryCodec(method), zero), zero)


@pytest.mark.parametrize("method,bits", [("int8", 8), ("int4", 4)])
def test_stochastic_rounding_is_within_a_step_and_unbiased(method: str, bits: int) -> None:
    row = torch.linspace(-1, 1, 64)  # absmax 1: the step is 1 / qmax
    x = row.repeat(4000, 1)
    out = _round_trip(BoundaryCodec(method, seed=1, stochastic=True), x)
    step = 1 / (2 ** (bits - 1) - 1)
    assert ((out - x).abs() <= step * (1 + 1e-5)).all()
    assert (out.mean(dim=0) - row).abs().max() < 0.1 * step  # to nearest would be off by up to step / 2
    nearest = _round_trip(BoundaryCodec(method), x)
    assert (nearest.mean(dim=0) - row).abs().max() > 0.3 * step


def test_int4_packs_two_signed_values_a_byte() -> None:
    codes = torch.tensor([[-7, -1, 0, 3, 7], [1, -2, 5, -6, 0]], dtype=torch.int8)
    packed = _pack_int4(codes)
    assert packed.shape == (2, 3)
    assert packed[0, 0].item() & 0x0F == (-7) & 0x0F  # even column in the low nibble
    assert torch.equal(_unpack_int4(packed, 5), codes)


def test_lowrank_is_exact_at_or_above_the_true_rank() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=gen) @ torch.randn(6, 64, generator=gen)
    for rank in (6, 12):
        out = _round_trip(BoundaryCodec("lowrank", rank=rank), x)
        assert torch.allclose(out, x, atol=1e-4 * x.abs().max().item())
    low = _round_trip(BoundaryCodec("lowrank", rank=3), x)
    assert (low - x).norm() > 0.05 * x.norm()  # below the rank it cannot be exact


def test_lowrank_basis_warm_starts_across_microbatches() -> None:
    gen = torch.Generator().manual_seed(1)
    basis = torch.linalg.qr(torch.randn(64, 8, generator=gen)).Q
    codec = BoundaryCodec("lowrank", rank=8)
    errors = []
    for _ in range(4):  # different samples of one subspace plus noise
        x = torch.randn(128, 8, generator=gen) @ basis.T + 0.01 * torch.randn(128, 64, generator=gen)
        errors.append(((_round_trip(codec, x) - x).norm() / x.norm()).item())
    assert codec._lowrank is not None and codec._lowrank.basis is not None
    # The noise outside the subspace, 0.01 * sqrt(56 / 8) ~ 2.6% of a row, is the floor.
    assert max(errors) < 0.03
    kept = codec._lowrank.basis  # the basis the next microbatch starts from spans the samples' subspace
    assert torch.linalg.matrix_norm(basis.T @ kept) ** 2 > 8 * 0.999


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_payload_is_wire_bytes(method: str, dtype: torch.dtype) -> None:
    x = torch.randn(2, 16, 33).to(dtype)  # odd dim: int4 pads a nibble
    codec = BoundaryCodec(method, rank=4)
    payload = codec.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == wire_bytes(method, 32, 33, x.element_size(), 4)
    assert encode_flops(method, 32, 33, 4) > 0


def test_wire_bytes_figures() -> None:
    assert wire_bytes("none", 512, 256, 4, 32) == 512 * 256 * 4
    assert wire_bytes("int8", 512, 256, 4, 32) == 512 * 260
    assert wire_bytes("int4", 512, 256, 4, 32) == 512 * 132
    assert wire_bytes("lowrank", 512, 256, 4, 32) == (512 + 256) * 32 * 4
    assert encode_flops("none", 512, 256, 32) == 0.0
