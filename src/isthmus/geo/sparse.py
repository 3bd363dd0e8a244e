"""Sparse 2-bit outer gradients for the WAN (``geo.outer_dtype = "topk2"``), after SparseLoCo.

SparseLoCo (arXiv 2508.15706) sends 1-3 % of a pseudo-gradient's entries at 2 bits each and keeps
the rest in an error-feedback accumulator, so nothing is lost, only delayed. Here a vector is cut
into chunks of ``block_size`` elements (the last one zero-padded), and each chunk sends its ``k``
entries of largest magnitude (``k = round(outer_density * block_size)``, at least 1):

- their offsets inside the chunk: one byte each for chunks of at most 256 elements, else two;
- a 2-bit code each, packed four per byte: a sign bit and a magnitude bit choosing between the
  chunk's two levels ``lo`` and ``hi`` (so four values, ``+-lo`` and ``+-hi``);
- the two levels as bf16, 4 bytes a chunk: split the k magnitudes at the midpoint of their range,
  ``lo`` is the mean of the lower group and ``hi`` that of the upper (one step of 2-means).

Every chunk sends the same number of bytes, so a payload's size depends only on the vector's
length and an all-gather over gloo needs no size exchange. At the defaults (256, 0.02: k = 5) a
chunk costs 5 + 1.25 + 4 = 10.25 bytes where int4 costs 128 + 4: 12.9x fewer.

With error feedback, ``residual = (x + beta * residual) - decoded``: the entries not sent stay in it
exactly, and the sent ones leave their quantisation error there. ``beta`` is ``geo.feedback_decay``
(1 by default; SparseLoCo's 0.95 lets what is never picked fade, its accumulator standing in for
outer momentum).

Under Streaming DiLoCo's mixing (``mix_alpha`` > 0) a datacenter keeps part of its own progress in
its parameters, where the next outer gradient finds it again, while the unsent part of it is also
in the residual: what is not sent counts up to ``1 / (1 - mix_alpha)`` times. Taking that share out
of the residual trained no better (docs/benchmarks.md), so the double count stays: it acts as the
outer momentum this kind otherwise lacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from isthmus.geo.compress import mean_decoded, with_feedback
from isthmus.layout.wire import n_chunks, topk2_offset_bytes


def encode(x: Tensor, block_size: int, k: int) -> Tensor:
    """The uint8 wire form of fp32 ``x``: offsets, then codes, then levels."""
    n = x.numel()
    chunks = F.pad(x.reshape(-1), (0, n_chunks(n, block_size) * block_size - n)).reshape(-1, block_size)
    idx = chunks.abs().topk(k, dim=1, sorted=False).indices
    picked = chunks.gather(1, idx)
    mag = picked.abs()
    upper = mag > (mag.amin(dim=1, keepdim=True) + mag.amax(dim=1, keepdim=True)) / 2
    lo = _group_mean(mag, ~upper)
    hi = torch.where(upper.any(dim=1), _group_mean(mag, upper), lo)
    levels = torch.stack([lo, hi], dim=1).to(torch.bfloat16)
    codes = (picked < 0).to(torch.uint8) | (upper.to(torch.uint8) << 1)
    offsets = idx.to(torch.uint8) if topk2_offset_bytes(block_size) == 1 else idx.to(torch.int16).view(torch.uint8)
    return torch.cat([offsets.reshape(-1), _pack2(codes.reshape(-1)), levels.reshape(-1).view(torch.uint8)])


def decode(payload: Tensor, numel: int, block_size: int, k: int) -> Tensor:
    """fp32 values of a payload made by :func:`encode` from ``numel`` elements (zeros where nothing was sent)."""
    c = n_chunks(numel, block_size)
    ob = topk2_offset_bytes(block_size)
    off_end, code_end = c * k * ob, c * k * ob + -(-c * k // 4)
    raw = payload[:off_end]
    idx = (raw.to(torch.int64) if ob == 1 else raw.clone().view(torch.int16).to(torch.int64) & 0xFFFF).view(c, k)
    codes = _unpack2(payload[off_end:code_end], c * k).view(c, k)
    levels = payload[code_end:].clone().view(torch.bfloat16).to(torch.float32).view(c, 2)
    mag = torch.where((codes >> 1).bool(), levels[:, 1:], levels[:, :1])
    values = torch.where((codes & 1).bool(), -mag, mag)
    out = torch.zeros(c, block_size, dtype=torch.float32, device=payload.device)
    return out.scatter_(1, idx, values).reshape(-1)[:numel]


def encode_with_feedback(x: Tensor, residual: Tensor | None, block_size: int, k: int, decay: float = 1.0) -> Tensor:
    """Encode ``x + decay * residual`` and keep what was not sent in ``residual`` (in place)."""
    return with_feedback(
        x, residual, lambda t: encode(t, block_size, k), lambda p: decode(p, x.numel(), block_size, k), decay
    )


def mean_of_payloads(gathered: Tensor, n: int, numel: int, block_size: int, k: int) -> Tensor:
    """Average of ``n`` payloads laid end to end, summed in rank order (identical on every receiver)."""
    return mean_decoded(gathered, n, lambda p: decode(p, numel, block_size, k))


def _group_mean(mag: Tensor, mask: Tensor) -> Tensor:
    """Per row, the mean of ``mag`` where ``mask`` (0 for a row with none)."""
    return (mag * mask).sum(dim=1) / mask.sum(dim=1).clamp_(min=1)


def _pack2(codes: Tensor) -> Tensor:
    """Four 2-bit codes per byte, element 4i + j in bits 2j, 2j + 1."""
    u = F.pad(codes, (0, -codes.numel() % 4)).reshape(-1, 4)
    return u[:, 0] | (u[:, 1] << 2) | (u[:, 2] << 4) | (u[:, 3] << 6)


def _unpack2(packed: Tensor, numel: int) -> Tensor:
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 3).reshape(-1)[:numel]
