"""Compressed pipeline boundaries (``geo.pp_compression``): what one activation or gradient costs on the WAN.

A pipeline stage boundary that crosses datacenters (``geo.dc_axis = pp``) carries every microbatch's
activations forward and their gradients back. A codec turns one such tensor, seen as ``(tokens, dim)``
rows (every leading dimension flattened), into one flat ``uint8`` payload that the P2P op sends instead,
and back. Sender and receiver know the tensor's shape and dtype (torch's pipeline receive buffers have
them), so the payload's layout follows from the shape alone and no header travels.

- ``int8`` / ``int4``: per-token absmax quantisation. Each row gets one fp32 scale (absmax / 127, or
  / 7 for int4: fp32 rather than bf16 costs 2 more bytes a row, under 1% of a row of 256 int8 values,
  and keeps the scale exact); int4 packs two values a byte (the row's even columns in the low
  nibble). Activations round to nearest; gradients round stochastically (unbiased, from a generator
  of the codec's own), which trained closer to exact boundaries than rounding them to nearest
  (dev/LOG.md).
- ``lowrank``: the rows are projected on an orthonormal basis ``Q`` (dim x r) of their span, found by
  subspace iteration (PowerSGD's one step of ``Q <- orth(X^T X Q)``, warm-started from the basis the
  same boundary and direction used for the previous microbatch); the payload is ``Q`` and
  ``C = X Q`` in the tensor's dtype, ``(tokens + dim) * r`` values, and the receiver rebuilds
  ``X' = C Q^T``, the projection of ``X`` on span(Q) (exact when ``X`` has rank <= r).

Why no error feedback: error feedback (as in the compressed gradient sync) adds what one step's
compression dropped to the next value sent through the same channel, which works when consecutive
values estimate the same quantity (a parameter's gradient from step to step). Consecutive
microbatches at a boundary are different samples: the dropped part of sample A's activation is
meaningless added to sample B's, and the receiver's forward is nonlinear, so the error cannot be
made up later. AQ-SGD's answer (compress the change of one sample's activation between epochs)
needs every sample's last activation stored and revisits that are rare in pretraining. What carries
over here instead is the *basis*: activations of different samples share a subspace (the residual
stream's), so the previous microbatch's ``Q`` is a good start, and one power iteration a microbatch
tracks it as the weights move. Quantisation keeps per-token scales instead of per-tensor, so no
token's rounding error depends on another's magnitude.

Hand-written: torch has int8 quantisation for tensors, but not a packed int4 wire format nor a
basis kept between sends; the arithmetic here is a few tensor ops either way.

:func:`compress_stage` puts a codec on a pipeline stage's P2P ops toward another datacenter: a send
encodes and sends the payload, a receive receives the payload into a buffer of its own and decodes it
into torch's receive buffer when the schedule waits on it, before the schedule reads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from isthmus.layout.choices import PP_COMPRESSIONS
from isthmus.layout.wire import QMAX, SCALE_BYTES, wire_bytes
from isthmus.parallel.striped import StripedWork

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def payload_numel(method: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, rank: int) -> int:
    """Bytes of the ``uint8`` payload that carries a tensor of ``shape`` and ``dtype``."""
    dim = shape[-1]
    tokens = math.prod(shape) // dim if dim else 0
    return wire_bytes(method, tokens, dim, dtype.itemsize, rank)


def quantise(x: Tensor, method: str, gen: torch.Generator | None = None) -> Tensor:
    """``x`` as its payload: the codes (int8, or int4 packed two a byte) then one fp32 scale a row.
    Rounded to nearest, or stochastically (unbiased: up with probability the fraction) with ``gen``."""
    qmax = QMAX[method]
    rows = _rows(x).float()
    scale = rows.abs().amax(dim=1, keepdim=True) / qmax
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = rows / safe
    if gen is None:
        scaled = torch.round(scaled)
    else:
        scaled = torch.floor(scaled + torch.rand(scaled.shape, generator=gen).to(scaled.device))
    codes = scaled.clamp_(-qmax, qmax).to(torch.int8)
    if method == "int4":
        codes = _pack_int4(codes)
    return torch.cat([codes.view(torch.uint8).reshape(-1), scale.reshape(-1).view(torch.uint8)])


def dequantise(payload: Tensor, method: str, out: Tensor) -> None:
    """Decode ``payload`` (from :func:`quantise`) into ``out``, in place."""
    rows = _rows(out)
    tokens, dim = rows.shape
    n_codes = payload.numel() - tokens * SCALE_BYTES
    codes = payload[:n_codes].view(torch.int8).reshape(tokens, -1)
    if method == "int4":
        codes = _unpack_int4(codes, dim)
    scale = payload[n_codes:].view(torch.float32).reshape(tokens, 1)
    rows.copy_(codes.float() * scale)


def _pack_int4(codes: Tensor) -> Tensor:
    """Two signed 4-bit values a byte: even columns in the low nibble, odd in the high (a zero pads an odd row)."""
    if codes.shape[1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    lo, hi = codes[:, 0::2], codes[:, 1::2]
    return ((lo & 0x0F) | (hi << 4)).to(torch.int8)


def _unpack_int4(packed: Tensor, dim: int) -> Tensor:
    # Arithmetic shifts of int8 sign-extend: (b << 4) >> 4 is the low nibble, b >> 4 the high one.
    lo = (packed << 4) >> 4
    hi = packed >> 4
    return torch.stack([lo, hi], dim=2).reshape(packed.shape[0], -1)[:, :dim]


class LowRank:
    """One boundary direction's low-rank codec: the sender keeps the basis between microbatches."""

    def __init__(self, rank: int, seed: int = 0):
        self.rank = rank
        self.seed = seed
        self.basis: Tensor | None = None
        """The previous microbatch's ``Q`` (dim x r, fp32), the next one's start."""

    def encode(self, x: Tensor) -> Tensor:
        """``Q`` then ``C = X Q`` (in ``x``'s dtype) as one flat ``uint8`` payload."""
        rows = _rows(x).float()
        dim = rows.shape[1]
        r = min(self.rank, dim)
        q = self.basis
        if q is None or q.shape != (dim, r):
            gen = torch.Generator(device="cpu").manual_seed(self.seed)
            q = torch.linalg.qr(torch.randn(dim, r, generator=gen).to(rows.device)).Q
        # One subspace iteration: Q spans the top-r right singular vectors better each call.
        q = torch.linalg.qr(rows.T @ (rows @ q)).Q
        self.basis = q
        c = rows @ q
        parts = [q.to(x.dtype).reshape(-1), c.to(x.dtype).reshape(-1)]
        return torch.cat(parts).view(torch.uint8)

    def decode(self, payload: Tensor, out: Tensor) -> None:
        """``out`` = ``C Q^T`` from a payload of :meth:`encode`."""
        rows = _rows(out)
        tokens, dim = rows.shape
        r = min(self.rank, dim)
        values = payload.view(out.dtype)
        q = values[: dim * r].reshape(dim, r).float()
        c = values[dim * r :].reshape(tokens, r).float()
        rows.copy_(c @ q.T)


class BoundaryCodec:
    """Encode and decode one boundary direction's tensors by ``method`` (``int8``, ``int4``, ``lowrank``)."""

    def __init__(self, method: str, rank: int = 32, seed: int = 0, stochastic: bool = False):
        assert method in PP_COMPRESSIONS and method != "none", method
        self.method = method
        self.rank = rank
        self._lowrank = LowRank(rank, seed) if method == "lowrank" else None
        # Its own generator: the training's random state stays what it is without compression.
        self._gen = torch.Generator(device="cpu").manual_seed(seed) if stochastic and method in QMAX else None

    def payload_bytes(self, like: Tensor) -> int:
        """Bytes of the payload that carries a tensor shaped as ``like``."""
        return payload_numel(self.method, like.shape, like.dtype, self.rank)

    def encode(self, x: Tensor) -> Tensor:
        """``x`` as a flat contiguous ``uint8`` payload of :meth:`payload_bytes` bytes."""
        with torch.no_grad():
            out = self._lowrank.encode(x) if self._lowrank is not None else quantise(x, self.method, self._gen)
        assert out.numel() == self.payload_bytes(x)
        return out.contiguous()

    def decode(self, payload: Tensor, out: Tensor) -> None:
        """Rebuild the tensor into ``out`` (contiguous), in place."""
        assert out.is_contiguous(), "decoding writes through a view of the receive buffer"
        with torch.no_grad():
            if self._lowrank is not None:
                self._lowrank.decode(payload, out)
            else:
                dequantise(payload, self.method, out)


_FACTORIES = ("get_fwd_send_ops", "get_fwd_recv_ops", "get_bwd_send_ops", "get_bwd_recv_ops")


def compress_stage(
    stage: PipelineStage,
    make_codec: Callable[[int, bool], BoundaryCodec],
    crosses: Callable[[int], bool],
    counter: dict[str, int],
) -> None:
    """Make the P2P ops of ``stage`` toward a peer for which ``crosses(peer group rank)`` holds move
    encoded payloads: each of the stage's four op kinds gets its own ``make_codec(seed, gradients)``
    (a sender's low-rank basis and random stream are per boundary and direction; ``gradients`` holds
    for the sends of gradients, which quantise with stochastic rounding), and ``counter["wan"]`` adds
    every payload sent.

    Applied after ``stripe_stage`` (the payload is what is striped) and before the time-shared
    turns and bubble filling, which wrap whatever ``op.op`` this leaves and call it with torch's tensor."""
    for i, name in enumerate(_FACTORIES):
        factory = getattr(stage, name)
        codec = make_codec(4 * stage.stage_index + i, name == "get_bwd_send_ops")
        sends = "send" in name

        def wrapped(
            chunk_id: int,
            _factory: Callable[[int], list[dist.P2POp]] = factory,
            _codec: BoundaryCodec = codec,
            _sends: bool = sends,
        ) -> list[dist.P2POp]:
            ops = _factory(chunk_id)
            return [_encoded(op, _codec, _sends, counter) if crosses(op.group_peer) else op for op in ops]

        setattr(stage, name, wrapped)


def _encoded(op: dist.P2POp, codec: BoundaryCodec, sends: bool, counter: dict[str, int]) -> dist.P2POp:
    inner = op.op

    # batch_isend_irecv passes group_dst= or group_src= by testing `op.op is isend`, which a wrapped op
    # is not: a plain isend / irecv gets its peer here; a striped op knows its peer and ignores keywords.
    def move(payload: Tensor, **kw: Any) -> Any:
        if inner is dist.isend:
            return dist.isend(payload, group=op.group, tag=op.tag, group_dst=op.group_peer)
        if inner is dist.irecv:
            return dist.irecv(payload, group=op.group, tag=op.tag, group_src=op.group_peer)
        return inner(payload, **kw)

    if sends:

        def run(tensor: Tensor, *_: Any, **kw: Any) -> StripedWork:
            payload = codec.encode(tensor)
            counter["wan"] += payload.numel()
            return StripedWork([move(payload, **kw)], keep=[payload])
    else:

        def run(tensor: Tensor, *_: Any, **kw: Any) -> StripedWork:
            payload = torch.empty(codec.payload_bytes(tensor), dtype=torch.uint8, device=tensor.device)
            return StripedWork([move(payload, **kw)], keep=[payload], then=lambda: codec.decode(payload, tensor))

    op.op = run
    return op
