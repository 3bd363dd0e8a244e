"""Colossal-AI's 2D, 2.5D and 3D tensor parallelism priced beside 1D tensor + sequence + context parallelism.

One transformer block, one microbatch of ``b`` sequences of ``s`` tokens, forward and backward, on
one device of a group of ``p`` devices that shares the block. Every scheme is counted collective by
collective as its implementation issues them (Colossal-AI's ``colossalai/legacy/nn/layer/parallel_2d``,
``parallel_2p5d`` and ``parallel_3d``: the ``_operation.py`` of each), each priced by the planner's
collective model on the span its group covers (:mod:`isthmus.planner.comm`), and every GEMM by
:func:`~isthmus.planner.compute.gemm_time` at the shape the scheme gives it. A linear layer
``Y = X W`` has ``X`` of M x K (M = b s tokens) and ``W`` of K x N:

- ``1d`` (Megatron, with sequence parallelism): tp = p; each block all-gathers its hidden states
  before attention and before the MLP and reduce-scatters after each, forward and backward.
- ``1d+cp``: tp at most one node, context parallelism (ring attention: K and V passed round the cp
  ranks) over the rest, with the block's state sharded over cp by FSDP as isthmus runs it (ZeRO-3:
  the tp shard of the weights all-gathered over cp for forward and for backward, the gradients
  reduce-scattered once a step).
- ``2d`` (Optimus, arXiv 2104.05343; SUMMA): a q x q grid, p = q^2; X and W in q x q blocks. Forward:
  q steps, each broadcasting one X block along the grid row and one W block along the column.
  Backward: dX = dY W^T broadcasts W blocks along columns and reduces dX blocks along rows, q steps;
  dW = X^T dY broadcasts X blocks along rows and reduces dW blocks along columns, q steps.
- ``2.5d`` (Tesseract, arXiv 2105.14500): d layers of a q x q grid, p = q^2 d; each layer runs 2D's
  SUMMA on its 1/d of the tokens with a full copy of the weights; the weight gradients are summed
  over the d layers once a step.
- ``3d`` (arXiv 2105.14450): a q x q x q cube, p = q^3. Forward all-gathers X over one axis and W over
  another, multiplies, and reduce-scatters Y over the third; backward all-gathers dY, reduce-scatters
  dX and dW. Successive linears swap the input and output axes.

2D, 2.5D and 3D split the batch of each microbatch over q, q d and q^2 of their devices (the sequence
stays whole, so attention stays local): ``b`` must be a multiple. Norm statistics (2D, 2.5D, 3D) are
all-reduced over the devices that split the hidden dimension. Per device, with e bytes an element:

    1d      fwd + bwd: 8 (p-1)/p M h e                               (4 all-gathers, 4 reduce-scatters)
    2d      per linear: 3 (q-1) (M K + K N) e / q^2
    2.5d    per linear: 3 (q-1) (M K / d + K N) e / q^2  + 2 (d-1)/d K N e / q^2 once a step
    3d      per linear: 2 (q-1) (M K + K N + M N) e / q^3

Groups are placed like the planner's mesh: ranks numbered node by node, the first axis of each grid
(2D and 2.5D rows, 3D's weight axis) on consecutive ranks, the others strided by q and q^2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs
from isthmus.planner import comm
from isthmus.planner.compute import ELEM_BYTES, BlockShape, gemm_time, layer_ops, layer_times
from isthmus.planner.cost import RING_HIDDEN_SHARE
from isthmus.planner.memory import USABLE_FRACTION, layer_activation_bytes
from isthmus.planner.topology import Datacenter, Link
from isthmus.planner.workload import Runtime

SCHEMES = ("1d", "1d+cp", "2d", "2.5d", "3d")
LINEAR_OPS = ("qkv", "proj", "fc1", "fc2")
"""The names `compute.layer_ops` gives a dense block's linear layers (the rest: norms, attention, activations)."""
STAT_BYTES = 4
"""Norm statistics are reduced in fp32."""
GRAD_BYTES = 4
"""Gradients are summed over replicas in fp32."""


@dataclass(frozen=True)
class Grid:
    """How ``devices`` share one block under ``scheme``: its degrees and each group's size and rank stride."""

    scheme: str
    devices: int
    q: int
    """tp for 1d and 1d+cp; the grid's side for 2d, 2.5d and 3d."""
    d: int = 1
    """cp for 1d+cp; the depth for 2.5d; 1 otherwise."""

    @property
    def label(self) -> str:
        return {
            "1d": f"tp {self.q}",
            "1d+cp": f"tp {self.q} cp {self.d}",
            "2d": f"{self.q}x{self.q}",
            "2.5d": f"{self.q}x{self.q}x{self.d}",
            "3d": f"{self.q}x{self.q}x{self.q}",
        }[self.scheme]

    @property
    def batch_split(self) -> int:
        """Ways the microbatch's sequences are split (the rest of the group splits the hidden dimension)."""
        return {"1d": 1, "1d+cp": 1, "2d": self.q, "2.5d": self.q * self.d, "3d": self.q * self.q}[self.scheme]

    @property
    def weight_split(self) -> int:
        """Ways each weight matrix is split (devices holding distinct pieces)."""
        return {"1d": self.q, "1d+cp": self.q, "2d": self.q**2, "2.5d": self.q**2, "3d": self.q**3}[self.scheme]

    def axes(self) -> dict[str, tuple[int, int]]:
        """Each group's (size, stride in ranks)."""
        q, d = self.q, self.d
        if self.scheme == "1d":
            return {"tp": (q, 1)}
        if self.scheme == "1d+cp":
            return {"tp": (q, 1), "cp": (d, q)}
        if self.scheme == "2d":
            return {"row": (q, 1), "col": (q, q)}
        if self.scheme == "2.5d":
            return {"row": (q, 1), "col": (q, q), "depth": (d, q * q)}
        return {"weight": (q, 1), "in": (q, q), "out": (q, q * q)}


def grids(devices: int, devices_per_node: int) -> list[Grid]:
    """The configuration of each scheme on ``devices`` that the scheme can form (2.5D: every depth
    d > 1 with q > 1; 1d+cp: tp filling one node, cp the rest)."""
    out = [Grid("1d", devices, devices)]
    if devices > devices_per_node and devices % devices_per_node == 0:
        out.append(Grid("1d+cp", devices, devices_per_node, devices // devices_per_node))
    q = math.isqrt(devices)
    if q > 1 and q * q == devices:
        out.append(Grid("2d", devices, q))
    for q in range(2, math.isqrt(devices) + 1):
        d, rest = divmod(devices, q * q)
        if rest == 0 and d > 1:
            out.append(Grid("2.5d", devices, q, d))
    q = round(devices ** (1 / 3))
    if q > 1 and q**3 == devices:
        out.append(Grid("3d", devices, q))
    return out


@dataclass(frozen=True)
class Collective:
    """One collective a device takes part in, ``count`` times per microbatch (per step: phase 'step')."""

    op: str
    """all_gather | reduce_scatter | all_reduce | broadcast | reduce | p2p."""
    axis: str
    nbytes: float
    """The full buffer of a gather, scatter or all-reduce; the message of a broadcast, reduce or p2p."""
    phase: str
    """fwd | bwd | step (once per optimizer step: a gradient sum over replicas)."""
    count: int = 1

    def volume(self, size: int) -> float:
        """Bytes one device receives, on average over the group, for all ``count`` of them."""
        if size <= 1:
            return 0.0
        share = {
            "all_gather": (size - 1) / size,
            "reduce_scatter": (size - 1) / size,
            "all_reduce": 2 * (size - 1) / size,
            "broadcast": (size - 1) / size,
            "reduce": (size - 1) / size,
            "p2p": 1.0,
        }[self.op]
        return self.count * share * self.nbytes


@dataclass(frozen=True)
class Linear:
    name: str
    k: int
    """Input features."""
    n: int
    """Output features."""


def block_linears(args: ModelArgs) -> list[Linear]:
    """A dense block's linear layers as one fused matmul each (QKV, the gate and up projections)."""
    if args.is_moe:
        raise ConfigError("model.n_experts", args.n_experts, "2D/2.5D/3D tensor parallelism is priced for dense blocks")
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    branches = 2 if args.mlp == "swiglu" else 1
    return [
        Linear("qkv", args.dim, q + 2 * kv),
        Linear("proj", q, args.dim),
        Linear("fc1", args.dim, branches * args.ffn_dim),
        Linear("fc2", args.ffn_dim, args.dim),
    ]


def _norm_stats(args: ModelArgs) -> int:
    """Statistics a norm reduces per row: RMSNorm the mean square; LayerNorm (GPT) mean and variance."""
    return 1 if args.mlp == "swiglu" else 2


def collectives(grid: Grid, args: ModelArgs, micro_batch: int, seq_len: int, dtype: str = "bf16") -> list[Collective]:
    """Every collective one device joins for one block and microbatch (and once a step)."""
    check(grid, args, micro_batch)
    e = ELEM_BYTES[dtype]
    m = micro_batch * seq_len
    q, d = grid.q, grid.d
    out: list[Collective] = []
    if grid.scheme in ("1d", "1d+cp"):
        c = d if grid.scheme == "1d+cp" else 1
        act = m / c * args.dim * e
        # Sequence parallelism: all-gather before attention and MLP, reduce-scatter after; backward mirrors.
        for phase in ("fwd", "bwd"):
            out += [Collective("all_gather", "tp", act, phase, 2), Collective("reduce_scatter", "tp", act, phase, 2)]
        if c > 1:
            kv = m / c * 2 * args.n_kv_heads * args.head_dim / q * e
            out += [Collective("p2p", "cp", kv, "fwd", c - 1), Collective("p2p", "cp", kv, "bwd", 2 * (c - 1))]
            # FSDP over cp (isthmus shards over dp_shard x cp): weights gathered for forward and again for
            # backward, gradients reduce-scattered once a step in fp32.
            params = sum(lin.k * lin.n for lin in block_linears(args)) / q
            out += [
                Collective("all_gather", "cp", params * e, "fwd"),
                Collective("all_gather", "cp", params * e, "bwd"),
            ]
            out.append(Collective("reduce_scatter", "cp", params * GRAD_BYTES, "step"))
        return out
    rows = m / grid.batch_split
    stats = _norm_stats(args)
    hidden_axis = {"2d": "row", "2.5d": "row", "3d": "in"}[grid.scheme]
    for _ in range(2):  # two norms a block
        out.append(Collective("all_reduce", hidden_axis, rows * STAT_BYTES, "fwd", stats))
        out.append(Collective("all_reduce", hidden_axis, rows * STAT_BYTES, "bwd", 2))
    for i, lin in enumerate(block_linears(args)):
        if grid.scheme in ("2d", "2.5d"):
            x_block = m / d / q * lin.k / q * e if grid.scheme == "2.5d" else m / q * lin.k / q * e
            w_block = lin.k / q * lin.n / q * e
            out += [
                Collective("broadcast", "row", x_block, "fwd", q),
                Collective("broadcast", "col", w_block, "fwd", q),
                # dX = dY W^T: W blocks down the columns, partial dX reduced along the rows.
                Collective("broadcast", "col", w_block, "bwd", q),
                Collective("reduce", "row", x_block, "bwd", q),
                # dW = X^T dY: X blocks along the rows, partial dW reduced down the columns.
                Collective("broadcast", "row", x_block, "bwd", q),
                Collective("reduce", "col", w_block, "bwd", q),
            ]
            if grid.scheme == "2.5d":
                out.append(Collective("all_reduce", "depth", w_block, "step"))
        else:
            a_in, a_out = ("in", "out") if i % 2 == 0 else ("out", "in")
            x_full = m / q * lin.k / q * e
            w_full = lin.k / q * lin.n / q * e
            y_full = m / q * lin.n / q * e
            out += [
                Collective("all_gather", a_in, x_full, "fwd"),
                Collective("all_gather", "weight", w_full, "fwd"),
                Collective("reduce_scatter", a_out, y_full, "fwd"),
                Collective("all_gather", a_out, y_full, "bwd"),
                Collective("reduce_scatter", a_in, x_full, "bwd"),
                Collective("reduce_scatter", "weight", w_full, "bwd"),
            ]
    return out


def check(grid: Grid, args: ModelArgs, micro_batch: int) -> None:
    """ConfigError where the scheme cannot split this microbatch."""
    if micro_batch % grid.batch_split:
        raise ConfigError(
            "micro_batch",
            micro_batch,
            f"{grid.scheme} {grid.label} splits each microbatch's sequences {grid.batch_split} ways: needs a multiple",
        )


def group_span(
    size: int, stride: int, devices: int, dc: Datacenter, dcs: int = 1, wan: Link | None = None
) -> comm.Span:
    """Where a group of ``size`` ranks spaced ``stride`` apart sits when ``devices`` ranks fill nodes of ``dc``
    in order, split evenly over ``dcs`` datacenters joined by ``wan``. Every group of the axis crosses the
    WAN at once, so all of a datacenter's ranks share it."""
    g = dc.devices_per_node
    per_site = devices // dcs
    group_dcs = min(dcs, size, max(1, size * stride // per_site)) if dcs > 1 else 1
    per_dc = size // group_dcs
    per_node = 1 if stride >= g else max(1, min(per_dc, g // stride))
    concurrent = devices // size if group_dcs > 1 else 1
    return comm.Span(per_node, max(1, per_dc // per_node), group_dcs, dc.intra_node, dc.fabric, wan, concurrent)


def broadcast(nbytes: float, span: comm.Span) -> float:
    """One root's ``nbytes`` to every member (or summed onto one: ``reduce``), pipelined down a chain through
    each tier in turn: each tier carries the whole message once and adds a latency per hop."""
    if span.size <= 1 or nbytes <= 0:
        return 0.0
    return sum((k - 1) * lat + nbytes / bw for k, bw, lat in span.tiers())


def collective_time(c: Collective, span: comm.Span) -> float:
    """Seconds of all ``count`` of ``c`` on ``span``."""
    if c.op == "all_gather":
        one = comm.all_gather(c.nbytes, span)
    elif c.op == "reduce_scatter":
        one = comm.reduce_scatter(c.nbytes, span)
    elif c.op == "all_reduce":
        one = comm.all_reduce(c.nbytes, span)
    elif c.op in ("broadcast", "reduce"):
        one = broadcast(c.nbytes, span)
    else:  # a ring hop waits for the slowest link the ring crosses
        one = max((lat + c.nbytes / bw for _, bw, lat in span.tiers()), default=0.0)
    return c.count * one


@dataclass(frozen=True)
class BlockPrice:
    """One block, one microbatch, one device of a ``grid``: communication, compute and memory."""

    grid: Grid
    comm_bytes: float
    """Bytes the device receives, forward and backward (and a microbatch's share of the step's gradient sums)."""
    comm_s: float
    """Seconds of those collectives, none hidden behind compute (ring attention's hidden share aside)."""
    compute_s: float
    state_bytes: float
    """Weights, gradients and optimizer state of the block's matmuls on this device."""
    activation_bytes: float
    """What the block keeps for its backward (3D: with the gathered inputs and weights it saves)."""
    buffer_bytes: float
    """Transient buffers while the block computes (see :func:`memory_bytes`)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def overlapped_s(self) -> float:
        """The step were every collective hidden behind compute that does not wait for it (the best any
        overlap reaches: Megatron's tp_comm_overlap for 1D, SUMMA's double-buffered broadcasts)."""
        return max(self.compute_s, self.comm_s)

    def layers_fit(self, memory: float, usable: float = USABLE_FRACTION) -> int:
        """Blocks one device holds at this price (state and one microbatch's activations each, one
        block's buffers), with nothing else on it."""
        return max(0, int((usable * memory - self.buffer_bytes) // (self.state_bytes + self.activation_bytes)))


def compute_seconds(
    grid: Grid, args: ModelArgs, micro_batch: int, seq_len: int, dtype: str, dc: Datacenter, runtime: Runtime
) -> float:
    """Forward and backward compute of one block on one device, each GEMM at the shape the scheme gives it."""
    kind = dc.kind
    if grid.scheme in ("1d", "1d+cp"):
        t = layer_times(kind, BlockShape(args, micro_batch, seq_len, grid.q, grid.d, True, dtype), runtime)
        return t.fwd + t.backward
    # Norms, attention and activations on the device's own batch rows and hidden columns.
    local = BlockShape(args, micro_batch // grid.batch_split, seq_len, grid.q, 1, True, dtype)
    rest = sum(op.seconds for op in layer_ops(kind, local, runtime) if op.name.split(".")[0] not in LINEAR_OPS)
    q, m = grid.q, micro_batch * seq_len
    gemms = 0.0
    for lin in block_linears(args):
        if grid.scheme == "3d":
            mm, kk, nn = m / q, lin.k / q, lin.n / q
            steps = 1
        else:  # SUMMA: q products of blocks, each step one broadcast block of X and one of W
            mm, kk, nn = m / grid.d / q if grid.scheme == "2.5d" else m / q, lin.k / q, lin.n / q
            steps = q
        gemms += steps * (
            gemm_time(kind, dtype, mm, nn, kk) + gemm_time(kind, dtype, mm, kk, nn) + gemm_time(kind, dtype, kk, nn, mm)
        )
    return rest + gemms


def memory_bytes(
    grid: Grid, args: ModelArgs, micro_batch: int, seq_len: int, dtype: str, runtime: Runtime
) -> tuple[float, float, float]:
    """(model state, activations, transient buffers) of one block on one device. The buffers live while one
    block computes (a layer deep, not one per block): 1D's all-gathered hidden states, FSDP's gathered
    weights (two blocks: one prefetched), SUMMA's double buffers of broadcast blocks and partial sums."""
    lins = block_linears(args)
    params = sum(lin.k * lin.n for lin in lins)
    e, q, m = ELEM_BYTES[dtype], grid.q, micro_batch * seq_len
    state = params / grid.weight_split * (runtime.weight_bytes + runtime.grad_bytes + runtime.optimizer_bytes)
    if grid.scheme in ("1d", "1d+cp"):
        block = BlockShape(args, micro_batch, seq_len, q, grid.d, True, dtype)
        gathered_act = m / grid.d * args.dim * e  # sequence parallelism's all-gathered hidden states
        if grid.scheme == "1d":
            return state, layer_activation_bytes(block, runtime), gathered_act
        # FSDP shards the state over cp too.
        return state / grid.d, layer_activation_bytes(block, runtime), gathered_act + 2 * params / q * e
    # Every tensor the block keeps is split over the whole grid (batch rows x hidden columns).
    whole = layer_activation_bytes(BlockShape(args, micro_batch, seq_len, 1, 1, False, dtype), runtime)
    act = whole / grid.devices
    rows = m / grid.batch_split
    if grid.scheme == "3d":
        # Each linear saves its all-gathered input (q times its own shard) and its all-gathered weight;
        # the buffers are the largest linear's gathered output gradient.
        inputs = sum(lin.k for lin in lins) * m * e
        act += (q - 1) * inputs / grid.devices + params * e / q**2
        return state, act, max(m / q * lin.n / q for lin in lins) * e
    # Two X blocks and two W blocks in flight (forward), two partial sums being reduced (backward).
    buffers = max(
        2 * (rows * lin.k / q + lin.k * lin.n / q**2) + 2 * max(rows * lin.k / q, lin.k * lin.n / q**2) for lin in lins
    )
    return state, act, buffers * e


def price(
    grid: Grid,
    args: ModelArgs,
    micro_batch: int,
    seq_len: int,
    dc: Datacenter,
    runtime: Runtime,
    dtype: str = "bf16",
    dcs: int = 1,
    wan: Link | None = None,
    microbatches_per_step: int = 8,
) -> BlockPrice:
    """One block of ``args`` under ``grid`` on ``dc``'s devices (over ``dcs`` datacenters joined by ``wan``);
    once-a-step gradient sums are shared over ``microbatches_per_step``."""
    check(grid, args, micro_batch)
    axes = grid.axes()
    spans = {name: group_span(size, stride, grid.devices, dc, dcs, wan) for name, (size, stride) in axes.items()}
    nbytes = seconds = 0.0
    compute = compute_seconds(grid, args, micro_batch, seq_len, dtype, dc, runtime)
    ring_fwd = ring_bwd = 0.0
    for c in collectives(grid, args, micro_batch, seq_len, dtype):
        share = 1 / microbatches_per_step if c.phase == "step" else 1.0
        nbytes += share * c.volume(axes[c.axis][0])
        t = share * collective_time(c, spans[c.axis])
        if c.op == "p2p":
            ring_fwd, ring_bwd = (ring_fwd + t, ring_bwd) if c.phase == "fwd" else (ring_fwd, ring_bwd + t)
        else:
            seconds += t
    if ring_fwd or ring_bwd:
        # As the cost model prices ring attention: its K and V hops hide behind a share of the block's forward.
        fwd = layer_times(dc.kind, BlockShape(args, micro_batch, seq_len, grid.q, grid.d, True, dtype), runtime).fwd
        hidden = RING_HIDDEN_SHARE * fwd
        seconds += max(0.0, ring_fwd - hidden) + max(0.0, ring_bwd - 2 * hidden)
    state, act, buffers = memory_bytes(grid, args, micro_batch, seq_len, dtype, runtime)
    return BlockPrice(grid, nbytes, seconds, compute, state, act, buffers)
