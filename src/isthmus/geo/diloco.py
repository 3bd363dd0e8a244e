"""DiLoCo and Streaming DiLoCo: datacenters train apart for H steps, then merge through an outer step.

DiLoCo (Douillard et al. 2023): every datacenter runs ``inner_steps`` (H) steps of its own inner
optimizer (the trainer's AdamW), averaging gradients only inside the datacenter. Then the
pseudo-gradient ``outer_grad = snapshot - params`` is averaged across datacenters and an outer
Nesterov SGD step moves the snapshot; every replica takes the new snapshot. The paper's step is lr
0.7 with momentum 0.9; the default here is lr 1 without momentum, the snapshot becoming the
datacenters' mean. The paper's step is made for hundreds of inner steps between syncs; with the
tens used here its momentum keeps re-applying outer gradients the inner optimizer has already
followed, and the mean trains closer to flat's loss (benchmarks/geo_sync.py --local; dev/LOG.md).

Streaming DiLoCo (Douillard et al. 2025) adds three things, all here:

- the parameters are cut into ``fragments`` contiguous runs (runs of layers); fragment f syncs
  after inner step t (1-based) when ``(t + f * H // fragments) % H == 0``, so WAN traffic is spread
  over the H steps and its peak is 1/fragments of DiLoCo's;
- the transfer is launched asynchronously and applied ``overlap_steps`` (tau) inner steps later,
  while training goes on: the outer step then uses the pseudo-gradient from launch time;
- outer gradients go on the WAN quantised (``outer_dtype``, int4 by default, with error feedback).

``outer_dtype = "topk2"`` sends SparseLoCo's sparse 2-bit outer gradients instead (isthmus.geo.sparse:
the largest ``outer_density`` of each chunk, the rest kept in the error feedback, which fades by
``feedback_decay`` a sync, SparseLoCo's beta), with either kind.

Merge after a delayed sync (our choice, after the paper's mixing): the fragment becomes
``alpha * local + (1 - alpha) * global`` where local has moved tau steps since launch. alpha = 0
replaces it by the global value, so every datacenter holds identical values right then, and the
tau steps of local progress on that fragment are dropped; alpha > 0 keeps part of them and leaves
the datacenters slightly apart (the global snapshot, which all outer steps use, stays identical).
Plain DiLoCo is the case fragments = 1, tau = 0 (no mixing).

Eager outer updates (``geo.eager``, Kale et al. 2025, "Eager updates for overlapped communication
and computation in DiLoCo"): a fragment's outer step is taken the moment it syncs, without waiting
for the WAN. The other datacenters' outer gradients of this sync are not there yet, so the step uses
this datacenter's fresh outer gradient in their place for now, and theirs from the previous sync of
the fragment, which had H steps to arrive: ``g = mean_prev + (own_now - own_prev) / n_dc``. Every
datacenter's outer gradient so enters every outer state exactly once, its own at once and the
others' one sync later. The transfer then overlaps H inner steps (tau = H, not 1): a link H times
slower keeps up. The datacenters' snapshots differ by their own latest terms (the paper's choice).
The fragment then takes ``alpha * local + (1 - alpha) * snapshot`` as above, with no tau steps
between: local is the value the outer gradient was taken from.

Outer state is sharded inside a datacenter: the replicas there are identical, so intra rank i
keeps the snapshot, momentum and residual of slice i only, sends slice i of the pseudo-gradient
over the WAN (k parallel rings, as hierarchical does), and an all-gather in the datacenter
reassembles the new parameters. Outer memory per rank is 2 / k (3 / k quantised) of the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from isthmus.config import GeoConfig, resolved_outer_dtype
from isthmus.geo import compress, sparse
from isthmus.geo.buckets import (
    Bucket,
    build_buckets,
    pack_grads,
    pack_params,
    split_fragments,
    unpack_grads,
    unpack_params,
)
from isthmus.geo.groups import GeoGroups
from isthmus.geo.strategy import GeoSync, Work, copy_state
from isthmus.layout.wire import topk2_chunk_k


@dataclass
class _Transfer:
    """One fragment's outer gradients on their way across the WAN."""

    fragment: int
    apply_at: int
    """Inner step (1-based count) after which the result is applied."""
    works: list[Work] = field(default_factory=list)
    buffers: list[Tensor] = field(default_factory=list)
    """Per bucket: the all-reduce buffer (fp32) or the all-gather output (encoded)."""
    payloads: list[Tensor] = field(default_factory=list)
    """Per bucket: the encoded input, kept alive until the collective is done."""
    mean: list[Tensor] | None = None
    """Per bucket: the outer gradient averaged across datacenters, once received."""
    own: list[Tensor] | None = None
    """eager: per bucket, this datacenter's outer gradient as the others decode it (its share of ``mean``)."""


class DiLoCoSync(GeoSync):
    """diloco (streaming=False) and streaming_diloco (streaming=True)."""

    def __init__(self, groups: GeoGroups, params: list[nn.Parameter], cfg: GeoConfig, streaming: bool) -> None:
        super().__init__(groups, params, cfg)
        self.kind = "streaming_diloco" if streaming else "diloco"
        self.inner_steps = cfg.inner_steps
        self.n_fragments = cfg.fragments if streaming else 1
        self.overlap_steps = cfg.overlap_steps if streaming else 0
        self.eager = cfg.eager
        self.alpha = cfg.mix_alpha if streaming else 0.0
        if self.eager:
            # A transfer is applied at the fragment's next sync, H steps after its launch.
            self.overlap_steps = self.inner_steps
        self.wire = resolved_outer_dtype(cfg, self.kind)
        # Nothing crosses a WAN with one datacenter: keep fp32 and skip the quantisation error.
        self.lossy = self.wire != "fp32" and groups.n_dc > 1
        self.topk = topk2_chunk_k(cfg.block_size, cfg.outer_density)
        """topk2: entries sent per chunk of block_size."""
        k = groups.intra_size
        self.fragments: list[list[Bucket]] = [
            build_buckets([params[i] for i in idx], self.bucket_numel, k, index=idx)
            for idx in split_fragments(params, self.n_fragments)
        ]
        self.grad_buckets = build_buckets(params, self.bucket_numel, multiple=1)
        self.offsets = [f * self.inner_steps // self.n_fragments for f in range(self.n_fragments)]
        """Fragment f syncs after inner step t when (t + offsets[f]) % inner_steps == 0."""
        # Outer state, this rank's slice of each bucket. The snapshot is the global parameters.
        self.snapshot = [[self._local_slice(params, b).clone() for b in frag] for frag in self.fragments]
        self.momentum = [[torch.zeros_like(s) for s in frag] for frag in self.snapshot]
        self.residuals: list[list[Tensor]] | None = None
        if self.lossy and cfg.error_feedback:
            self.residuals = [[torch.zeros_like(s) for s in frag] for frag in self.snapshot]
        self.pending: list[_Transfer] = []

    def _shard(self, buf: Tensor, b: Bucket) -> Tensor:
        return buf[b.shard(self.groups.intra_rank, self.groups.intra_size)]

    # -- trainer hooks ---------------------------------------------------------------------------

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Average gradients inside the datacenter only; nothing crosses the WAN."""
        self._check(params)
        k = self.groups.intra_size
        if k == 1:
            return
        for b in self.grad_buckets:
            buf = pack_grads(params, b, self._zeros(b.padded))
            self._all_reduce(buf, "intra")
            unpack_grads(buf.div_(k), params, b)

    def syncs_at(self, step: int) -> list[int]:
        """Fragments whose transfer launches after 0-based inner step ``step``."""
        t = step + 1
        return [f for f, off in enumerate(self.offsets) if (t + off) % self.inner_steps == 0]

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        self._check(params)
        t = step + 1
        if self.eager:
            for f in self.syncs_at(step):
                self._eager_sync(f, t, params)
            return
        for f in self.syncs_at(step):
            self.pending.append(self._launch(f, t, params))
        for tr in [tr for tr in self.pending if tr.apply_at <= t]:
            self._apply(tr, params)

    def params_agree_after(self, step: int) -> bool:
        """diloco: after each outer step; streaming: never all fragments at once; eager: never."""
        return self.n_fragments == 1 and self.alpha == 0 and not self.eager and (step + 1) % self.inner_steps == 0

    def finish(self, params: list[nn.Parameter]) -> None:
        """Apply every transfer still in flight, so training ends with all results merged.

        It does not force an outer step: a diloco run whose length is not a multiple of
        inner_steps ends with the datacenters apart by the local steps since the last one.
        """
        self._check(params)
        for tr in list(self.pending):
            if self.eager:
                assert tr.own is not None, "an eager transfer keeps this datacenter's share"
                # The others' last outer gradients, on top of the local steps taken since.
                late = [m.sub(o, alpha=1 / self.groups.n_dc) for m, o in zip(self._receive(tr), tr.own, strict=True)]
                self._outer_step(tr.fragment, late, params, keep_local=True)
                self.pending.remove(tr)
            else:
                self._apply(tr, params)

    # -- one fragment's outer sync ---------------------------------------------------------------------

    def _launch(self, f: int, t: int, params: list[nn.Parameter]) -> _Transfer:
        """Compute the outer gradients of fragment f and start averaging them across datacenters."""
        return self._send(f, t, self._outer_grads(f, params))

    def _outer_grads(self, f: int, params: list[nn.Parameter]) -> list[Tensor]:
        """Per bucket of fragment f, this rank's slice of snapshot - params (new tensors)."""
        return [self.snapshot[f][i] - self._local_slice(params, b) for i, b in enumerate(self.fragments[f])]

    def _local_slice(self, params: list[nn.Parameter], b: Bucket) -> Tensor:
        """This rank's slice of bucket b's current parameter values (a new tensor)."""
        return self._shard(pack_params(params, b, self._zeros(b.padded)), b)

    def _send(self, f: int, t: int, outer_grads: list[Tensor]) -> _Transfer:
        """Start averaging ``outer_grads`` (consumed: fp32 ones are reduced in place) across datacenters."""
        tr = _Transfer(fragment=f, apply_at=t + self.overlap_steps)
        n_dc = self.groups.n_dc
        own: list[Tensor] = []
        for i, outer_grad in enumerate(outer_grads):
            if not self.lossy:
                if self.eager:
                    own.append(outer_grad.clone())
                tr.works.append(self._all_reduce(outer_grad, "inter", async_op=True))
                tr.buffers.append(outer_grad)
                continue
            residual = self.residuals[f][i] if self.residuals is not None else None
            payload = self._encode(outer_grad, residual)
            if self.eager:
                own.append(self._decode(payload, outer_grad.numel()))
            gathered = torch.empty(n_dc * payload.numel(), dtype=torch.uint8, device=self.device)
            tr.works.append(self._all_gather(gathered, payload, "inter", async_op=True))
            tr.buffers.append(gathered)
            tr.payloads.append(payload)
        tr.own = own if self.eager else None
        return tr

    def _eager_sync(self, f: int, t: int, params: list[nn.Parameter]) -> None:
        """Eager outer step of fragment f: own fresh outer gradient, the others' from the last sync."""
        fresh = self._outer_grads(f, params)
        prev = next((tr for tr in self.pending if tr.fragment == f), None)
        self.pending.append(self._send(f, t, [g.clone() for g in fresh]))
        n_dc = self.groups.n_dc
        if prev is None:  # the first sync: nothing from the others yet (the paper's start)
            grads = [g.div_(n_dc) for g in fresh]
        else:
            assert prev.own is not None
            mean = self._receive(prev)
            grads = [m - o.div(n_dc) + g.div_(n_dc) for m, o, g in zip(mean, prev.own, fresh, strict=True)]
            self.pending.remove(prev)
        self._outer_step(f, grads, params, keep_local=False)

    def _receive(self, tr: _Transfer) -> list[Tensor]:
        """Wait for a transfer and decode the mean outer gradient (once)."""
        if tr.mean is None:
            n_dc = self.groups.n_dc
            mean = []
            for work, buf, b in zip(tr.works, tr.buffers, self.fragments[tr.fragment], strict=True):
                work.wait()
                shard_numel = b.padded // self.groups.intra_size
                if self.lossy:
                    mean.append(self._mean_of_payloads(buf, n_dc, shard_numel))
                else:
                    mean.append(buf.div_(n_dc))
            tr.mean, tr.works, tr.buffers, tr.payloads = mean, [], [], []
        return tr.mean

    def _encode(self, x: Tensor, residual: Tensor | None) -> Tensor:
        """The wire form of ``x`` (plus ``residual``, which keeps the new error) in outer_dtype."""
        decay = self.cfg.feedback_decay
        if self.wire == "topk2":
            return sparse.encode_with_feedback(x, residual, self.cfg.block_size, self.topk, decay)
        return compress.encode_with_feedback(x, residual, self.wire, self.cfg.block_size, decay)

    def _decode(self, payload: Tensor, numel: int) -> Tensor:
        if self.wire == "topk2":
            return sparse.decode(payload, numel, self.cfg.block_size, self.topk)
        return compress.decode(payload, self.wire, numel, self.cfg.block_size)

    def _mean_of_payloads(self, gathered: Tensor, n: int, numel: int) -> Tensor:
        if self.wire == "topk2":
            return sparse.mean_of_payloads(gathered, n, numel, self.cfg.block_size, self.topk)
        return compress.mean_of_payloads(gathered, n, self.wire, numel, self.cfg.block_size)

    def _apply(self, tr: _Transfer, params: list[nn.Parameter]) -> None:
        """Outer Nesterov step on the fragment's snapshot, then merge it into the parameters."""
        self._outer_step(tr.fragment, self._receive(tr), params, keep_local=False)
        self.pending.remove(tr)

    def _outer_step(self, f: int, grads: list[Tensor], params: list[nn.Parameter], keep_local: bool) -> None:
        """Outer Nesterov step of fragment f's snapshot on ``grads``; the parameters then take the
        snapshot (mixed with the local values by mix_alpha), or with ``keep_local`` move by the step."""
        lr, mu = self.cfg.outer_lr, self.cfg.outer_momentum
        for i, (b, g) in enumerate(zip(self.fragments[f], grads, strict=True)):
            # torch.optim.SGD(nesterov=True, dampening=0): buf = mu * buf + g; step = g + mu * buf.
            if mu > 0:
                m = self.momentum[f][i].mul_(mu).add_(g)
                g = g.add(m, alpha=mu)
            snap = self.snapshot[f][i].sub_(g, alpha=lr)
            if keep_local:
                merged = self._local_slice(params, b).sub_(g, alpha=lr)
            elif self.alpha > 0:
                local = self._local_slice(params, b)
                merged = local.mul_(self.alpha).add_(snap, alpha=1 - self.alpha)
            else:
                merged = snap
            full = self._zeros(b.padded)
            self._all_gather(full, merged, "intra")
            unpack_params(full, params, b)

    # -- checkpoints -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Snapshot, momentum, residuals and in-flight results (waited for and decoded: a collective)."""
        state = super().state_dict()
        state.update(
            snapshot=_clone(self.snapshot),
            momentum=_clone(self.momentum),
            residuals=_clone(self.residuals),
            pending=[
                {
                    "fragment": tr.fragment,
                    "apply_at": tr.apply_at,
                    "mean": [m.clone() for m in self._receive(tr)],
                    "own": None if tr.own is None else [o.clone() for o in tr.own],
                }
                for tr in self.pending
            ],
        )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for name in ("snapshot", "momentum", "residuals"):
            mine, saved = getattr(self, name), state[name]
            if mine is None or saved is None:
                continue
            copy_state(name, [t for frag in mine for t in frag], [t for frag in saved for t in frag])
        self.pending = [
            _Transfer(
                fragment=p["fragment"],
                apply_at=p["apply_at"],
                mean=[m.clone() for m in p["mean"]],
                own=None if p.get("own") is None else [o.clone() for o in p["own"]],
            )
            for p in state["pending"]
        ]


def _clone(nested: list[list[Tensor]] | None) -> list[list[Tensor]] | None:
    return None if nested is None else [[t.clone() for t in frag] for frag in nested]
