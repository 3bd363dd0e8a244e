"""Context parallelism: shard the sequence over a process group and attend across it.

torch's ``context_parallel`` has no sharding rule for the CPU flash-attention op, so
this module implements its own, on plain ``torch.distributed`` calls that gloo and
NCCL both provide.

Layout. With ``cp`` ranks the sequence is cut into ``2 * cp`` equal chunks and rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r``. Under a causal mask an early chunk
is cheap and a late one expensive; pairing them gives every rank the same work.

Two kernels replace ``Attention.sdpa`` (both take q as [B, H, S_local, Dh] and k, v as
[B, Hkv, S_local, Dh], grouped-query attention's fewer heads, which travel as they are):

* ring: q stays put, k/v blocks travel around the ring, partial results are merged
  with an online softmax (log-sum-exp, fp32). Backward recomputes each block and
  sends the dk/dv accumulators around the ring with the k/v blocks.
* ulysses: an all-to-all turns the sequence shard into a head shard with the full
  sequence, ordinary causal attention runs locally, and an all-to-all turns it back.
  gloo implements ``all_to_all_single`` on CPU in torch 2.13, so it is used directly.

Loss. Every rank sees ``S / cp`` tokens of each sequence; a rank's loss must be the
mean over its own tokens divided by ``cp`` so that the gradients *summed* over the cp
group (which FSDP/DDP do when cp is folded into their group) equal the gradient of
the mean over the whole sequence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from isthmus.errors import ConfigError
from isthmus.layout.choices import CP_IMPLS as _CP_IMPLS
from isthmus.models.llama import Attention

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]
CP_IMPLS = _CP_IMPLS


def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Global indices of the two sequence chunks (of ``2 * cp_size``) that ``cp_rank`` holds."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cp_shard(x: Tensor, dim: int, cp_rank: int, cp_size: int) -> Tensor:
    """This rank's load-balanced part of ``x`` along ``dim``: chunks r and 2*cp-1-r."""
    if x.shape[dim] % (2 * cp_size):
        raise ConfigError("parallel.cp", cp_size, f"2 * cp must divide the sequence length {x.shape[dim]}")
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = cp_chunk_ids(cp_rank, cp_size)
    return torch.cat((chunks[first], chunks[second]), dim=dim)


def cp_unshard(shards: Sequence[Tensor], dim: int) -> Tensor:
    """Inverse of :func:`cp_shard`: the full tensor from every rank's shard, in rank order."""
    cp_size = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    # Chunk g < cp is rank g's first half; chunk g >= cp is rank (2cp-1-g)'s second half.
    ordered = [halves[g][0] if g < cp_size else halves[2 * cp_size - 1 - g][1] for g in range(2 * cp_size)]
    return torch.cat(ordered, dim=dim)


def cp_positions(seq_len: int, cp_rank: int, cp_size: int, device: torch.device | str | None = None) -> Tensor:
    """Global positions (LongTensor [seq_len / cp]) of this rank's tokens, for RoPE."""
    return cp_shard(torch.arange(seq_len, device=device), 0, cp_rank, cp_size)


def _ring_exchange(send: Tensor, group: dist.ProcessGroup, tag: int) -> tuple[list[Any], Tensor]:
    """Start sending ``send`` to the next rank and receiving its twin from the previous one."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size, tag=tag),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size, tag=tag),
    ]
    return dist.batch_isend_irecv(ops), recv


def _wait(works: list[Any]) -> None:
    for work in works:
        work.wait()


def _block_pairs(rank: int, src: int, size: int, chunk: int) -> list[tuple[slice, slice, bool]]:
    """(local q rows, local kv cols, diagonal?) for every block with any causal overlap.

    Decided on global chunk indices: a key chunk before the query chunk is attended in
    full, the same chunk gets the causal triangle, a later one is skipped.
    """
    pairs = []
    for qi, qg in enumerate(cp_chunk_ids(rank, size)):
        for ki, kg in enumerate(cp_chunk_ids(src, size)):
            if kg <= qg:
                pairs.append((slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk), kg == qg))
    return pairs


def _scores(q: Tensor, k: Tensor, scale: float, diagonal: bool) -> Tensor:
    """fp32 scores [B, Hkv, rep, c, c] of q [B, Hkv, rep, c, D] against k [B, Hkv, 1, c, D]."""
    s = (q @ k.transpose(-1, -2)) * scale
    if diagonal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


class RingAttention(torch.autograd.Function):
    """Exact causal attention over the cp group; q [B, H, S, D], k/v [B, Hkv, S, D] local shards."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        bsz, heads, seq, dim = q.shape
        kv_heads = k.shape[1]
        assert seq % 2 == 0 and k.shape[2] == seq and heads % kv_heads == 0, (q.shape, k.shape)
        scale = 1.0 / math.sqrt(dim)
        # GQA by grouping: q becomes [B, Hkv, rep, S, D] and broadcasts against one kv
        # head, so only the smaller k/v travel the ring (repeat_interleave's head order).
        q5 = q.float().view(bsz, kv_heads, heads // kv_heads, seq, dim)
        out = torch.zeros_like(q5)
        lse = torch.full(q5.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        for step in range(size):
            if step < size - 1:
                works, next_kv = _ring_exchange(kv, group, tag=0)  # overlaps this step's math
            kf, vf = kv.float().unsqueeze(3).unbind(0)
            for rows, cols, diagonal in _block_pairs(rank, (rank - step) % size, size, seq // 2):
                s = _scores(q5[..., rows, :], kf[..., cols, :], scale, diagonal)
                lse_b = torch.logsumexp(s, dim=-1)
                out_b = torch.exp(s - lse_b.unsqueeze(-1)) @ vf[..., cols, :]
                # Online softmax merge; step 0 always has the diagonal block, so lse is
                # finite before any -inf could meet -inf.
                new = torch.logaddexp(lse[..., rows], lse_b)
                out[..., rows, :] = out[..., rows, :] * torch.exp(lse[..., rows] - new).unsqueeze(
                    -1
                ) + out_b * torch.exp(lse_b - new).unsqueeze(-1)
                lse[..., rows] = new
            if step < size - 1:
                _wait(works)
                kv = next_kv
        ctx.group, ctx.scale = group, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out.view(bsz, heads, seq, dim).to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        bsz, heads, seq, dim = q.shape
        q5 = q.float().view(out.shape)
        do = grad_out.float().reshape(out.shape)
        delta = (do * out).sum(-1)  # rowsum(dO * O), the softmax-backward correction
        dq = torch.zeros_like(q5)
        kv = torch.stack((k, v)).contiguous()
        dkv_works: list[Any] = []
        dkv_in: Tensor | None = None
        for step in range(size):
            if step < size - 1:
                works, next_kv = _ring_exchange(kv, group, tag=1)
            kf, vf = kv.float().unsqueeze(3).unbind(0)
            dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
            for rows, cols, diagonal in _block_pairs(rank, (rank - step) % size, size, seq // 2):
                p = torch.exp(_scores(q5[..., rows, :], kf[..., cols, :], scale, diagonal) - lse[..., rows, None])
                d_o = do[..., rows, :]
                dv[..., cols, :] += (p.transpose(-1, -2) @ d_o).sum(2, keepdim=True)
                ds = p * (d_o @ vf[..., cols, :].transpose(-1, -2) - delta[..., rows, None])
                dq[..., rows, :] += (ds @ kf[..., cols, :]) * scale
                dk[..., cols, :] += (ds.transpose(-1, -2) @ q5[..., rows, :]).sum(2, keepdim=True) * scale
            # The accumulator for this kv block arrives from the previous rank (which
            # added its share last step) and leaves for the next; after `size` hops
            # each block's dk/dv have visited every rank and are back at the owner.
            acc = torch.stack((dk, dv)).squeeze(3)
            if dkv_in is not None:
                _wait(dkv_works)
                acc = acc + dkv_in
            if size > 1:
                dkv_works, dkv_in = _ring_exchange(acc.contiguous(), group, tag=2)
            else:
                dkv_in = acc
            if step < size - 1:
                _wait(works)
                kv = next_kv
        _wait(dkv_works)
        assert dkv_in is not None
        dk_full, dv_full = dkv_in.unbind(0)
        return dq.view(bsz, heads, seq, dim).to(q.dtype), dk_full.to(k.dtype), dv_full.to(v.dtype), None


def _seq_to_heads(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[B, H, S/cp, D] load-balanced sequence shard -> [B, H/cp, S, D] in natural order."""
    size = dist.get_world_size(group)
    bsz, heads, seq, dim = x.shape
    send = x.reshape(bsz, size, heads // size, seq, dim).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] is rank j's shard of our heads; undo the load-balanced chunk order so a
    # plain causal mask is right.
    return cp_unshard(list(recv.unbind(0)), dim=2)


def _heads_to_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Inverse of :func:`_seq_to_heads`: [B, H/cp, S, D] -> [B, H, S/cp, D]."""
    size = dist.get_world_size(group)
    send = torch.stack([cp_shard(x, 2, j, size) for j in range(size)]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    bsz, _, seq, dim = x.shape
    return recv.transpose(0, 1).reshape(bsz, -1, seq // size, dim)


class _SwapShard(torch.autograd.Function):
    """Sequence shard <-> head shard; the gradient of one all-to-all is the inverse one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(grad.contiguous(), ctx.group), None, None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Causal attention by two all-to-alls around a local full-sequence SDPA."""
    size = dist.get_world_size(group)
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads % size:
        # Too few kv heads to split: repeat them up to the q heads (GQA's own mapping).
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    if heads % size:
        raise ConfigError("parallel.cp", size, f"ulysses needs cp to divide the attention heads ({heads})")
    q, k, v = (_SwapShard.apply(t, group, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    return _SwapShard.apply(out, group, False)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Causal ring attention over ``group`` (differentiable)."""
    return RingAttention.apply(q, k, v, group)


def make_cp_sdpa(impl: str, group: dist.ProcessGroup) -> AttentionFn:
    """A ``q, k, v -> out`` kernel for ``Attention.sdpa`` that attends across ``group``."""
    if impl == "ring":
        return lambda q, k, v: ring_attention(q, k, v, group)
    if impl == "ulysses":
        return lambda q, k, v: ulysses_attention(q, k, v, group)
    raise ConfigError("parallel.cp_impl", impl, f"choose one of: {', '.join(CP_IMPLS)}")


def apply_cp(model: nn.Module, cp_group: dist.ProcessGroup, impl: str) -> None:
    """Make every Attention in ``model`` (wrapped or not) attend across ``cp_group``.

    The caller shards tokens, labels and positions with :func:`cp_shard` /
    :func:`cp_positions` and passes ``positions`` to ``Transformer.forward``.
    """
    sdpa = make_cp_sdpa(impl, cp_group)
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    assert attentions, "apply_cp found no Attention modules"
    for attention in attentions:
        attention.sdpa = sdpa
