"""Error feedback with a decaying accumulator (geo.feedback_decay, SparseLoCo's beta) for the outer
gradients' codecs. Tensors only, no processes."""

from __future__ import annotations

import pytest
import torch

from isthmus.config import GeoConfig
from isthmus.config import validate_geo as validate
from isthmus.errors import ConfigError
from isthmus.geo import compress, sparse
from isthmus.layout import wire

BS = 256
K = wire.topk2_chunk_k(BS, 0.02)


def _vector(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _sent(payload: torch.Tensor, n: int) -> torch.Tensor:
    return sparse.decode(payload, n, BS, K)


def test_decay_one_is_bit_identical_to_plain_feedback() -> None:
    x, r = _vector(4 * BS, 0), _vector(4 * BS, 1)
    r1, r2 = r.clone(), r.clone()
    p1 = sparse.encode_with_feedback(x, r1, BS, K)
    p2 = sparse.encode_with_feedback(x, r2, BS, K, decay=1.0)
    assert torch.equal(p1, p2) and torch.equal(r1, r2)
    q1, q2 = r.clone(), r.clone()
    assert torch.equal(
        compress.encode_with_feedback(x, q1, "int4", BS), compress.encode_with_feedback(x, q2, "int4", BS, 1.0)
    )
    assert torch.equal(q1, q2)


def test_decay_scales_the_old_residual_before_adding() -> None:
    """residual' = x + beta * residual - sent, and the top-k is taken of x + beta * residual."""
    beta = 0.9
    x, r = _vector(4 * BS, 2), _vector(4 * BS, 3) * 3
    target = x + beta * r
    new = r.clone()
    sent = _sent(sparse.encode_with_feedback(x, new, BS, K, decay=beta), x.numel())
    for c in range(4):
        chunk = slice(c * BS, (c + 1) * BS)
        assert set(sent[chunk].nonzero().flatten().tolist()) == set(target[chunk].abs().topk(K).indices.tolist())
    torch.testing.assert_close(new, target - sent, rtol=0, atol=1e-6)
    # An entry that is never picked (K larger ones arrive every time) fades geometrically.
    x, far = torch.zeros(BS), torch.zeros(BS)
    x[:K], far[-1] = 10.0, 1.0
    for _ in range(10):
        sparse.encode_with_feedback(x, far, BS, K, decay=beta)
    assert far[-1].item() == pytest.approx(beta**10, rel=1e-5)


def test_config_rules() -> None:
    assert GeoConfig().feedback_decay == 1.0
    validate(GeoConfig(sync="streaming_diloco", outer_dtype="topk2", feedback_decay=0.95))
    for bad, key in (
        ({"feedback_decay": 0.0}, "geo.feedback_decay"),
        ({"feedback_decay": 1.5}, "geo.feedback_decay"),
    ):
        with pytest.raises(ConfigError, match=key):
            validate(GeoConfig(sync="streaming_diloco", outer_dtype="topk2", **bad))
