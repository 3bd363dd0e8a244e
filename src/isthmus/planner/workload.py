"""What the planner reasons about: the workload, one candidate layout, and the runtime's habits.

A :class:`~isthmus.layout.spec.LayoutSpec` is one way to run a :class:`Workload` on a topology: the
parallel degrees and schedule plus where datacenter boundaries fall and how data parallelism
crosses them, in the config's own key names (``isthmus.layout``). A :class:`Runtime` holds the assumptions about the software that runs it
(attention kernel, dropout, what overlaps with what, bytes per parameter), so the same cost model
can describe isthmus itself and the Megatron-LM of 2021 that published Table 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from isthmus.models.args import ModelArgs

__all__ = [
    "COMPILED",
    "DEFAULT_GPU_RUNTIME",
    "FEATURES",
    "PLANNED_DTYPES",
    "RUNTIMES",
    "TRAINED_DTYPES",
    "Fp8Recipe",
    "Runtime",
    "TpOverlap",
    "Workload",
]

TpOverlap = Literal["none", "bulk", "pipelined"]
Fp8Recipe = Literal["tensorwise", "rowwise", "blockwise", "mxfp8"]

COMPILED = "+compile"
"""The suffix of a runtime's name whose blocks are compiled (`Runtime.with_compile`)."""
TRAINED_DTYPES = ("fp32", "bf16")
"""What ``train.dtype`` takes: the precisions isthmus trains in."""
PLANNED_DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
"""Matmul dtypes the planner prices (``--train.dtype`` of ``isthmus plan`` and ``simulate``): isthmus's
own, and the published runs' tf32, fp16 and fp8."""


@dataclass(frozen=True)
class Workload:
    """What to train: the model shape and the training shape of one optimizer step."""

    args: ModelArgs
    batch_size: int
    """Sequences per optimizer step (``train.batch_size``)."""
    seq_len: int
    dtype: str = "bf16"
    """Compute dtype of the matmuls (selects the device's peak)."""

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class Runtime:
    """Assumptions about the training software; every one is listed in docs/runtimes.md."""

    name: str
    attention: Literal["flash", "materialized"]
    """flash: fused attention, no S x S tensor; materialized: softmax over a stored S x S score matrix."""
    dropout: bool
    """Dropout on attention probabilities and after each residual branch (masks cost memory and time)."""
    dp_overlap: bool
    """Data-parallel gradient reduction (all-reduce or reduce-scatter) overlaps the backward of the last
    microbatch, bucket by bucket (DDP, FSDP2, Megatron's --overlap-grad-reduce)."""
    p2p_async: bool
    """Pipeline sends overlap compute (a link is its own pipeline stage) rather than blocking the sender."""
    scatter_gather: bool
    """Pipeline activations are split across the tensor-parallel ranks, each sending 1/tp (Megatron)."""
    weight_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    """Bytes per parameter of weights, gradients and optimizer state (master copy + Adam moments)."""
    selective: Literal["alternate_blocks", "attention_core"] | None = "alternate_blocks"
    """What ``activation_checkpoint = selective`` recomputes: every other block whole (isthmus), or
    only each block's attention core, the softmax over the score matrix and what feeds it
    (Korthikanti et al. 2022, Megatron-LM since 2022): all blocks keep their other activations.
    None: the software had no selective recomputation."""
    p2p_rendezvous: bool = False
    """Blocking p2p one tensor per call, each call holding both ends for the whole transfer: an
    interior stage spends four transfers per microbatch (receive and send the activation, receive and
    send its gradient) instead of one exchange per neighbour (DeepSpeed's pipeline engine)."""
    sequence_parallel: bool = True
    """The software has sequence parallelism (Megatron-LM from 2022; isthmus)."""
    gathered_across_microbatches: bool = False
    """Under a pipeline, ZeRO-3 / FSDP weights are gathered once per step and kept until its last
    backward (FSDP without resharding after forward, as Llama 3's training did) instead of gathered
    again for every microbatch."""
    pointwise_recompute: bool = False
    """Backward recomputes a block's pointwise results (the norms' outputs, the SiLU and the gated
    product) from the tensors they came from, as a compiled block does (torch.compile's partitioner
    keeps only what matmuls and attention read); False: eager autograd stores each of them."""
    eager_llama_block: bool = False
    """What isthmus's eager Llama block keeps in fp32 beyond the lean accounting, as measured on CPU
    ranks (saved-tensor hooks per block, torch.profiler's memory events per rank:
    benchmarks/peak_memory.py): under sequence parallelism the matmuls keep the all-gathered
    norm outputs. (Its RMSNorm keeps the input and the per-token rsqrt alone, as a
    fused kernel: two tensors of the hidden size per norm with its output; its attention kernels,
    SDPA and the context-parallel ones, take K and V grouped, at their own size.) isthmus's own
    runtime counts the same block under bf16 (``autocast``). Off for the `torchtitan` runtime, its
    published runs' own model, which the lean accounting fits (Llama 3.1 8B on H100 96GB reported
    82.4 GiB, 88.5 GB, counted 85.1 GB)."""
    tp_host_memory: bool = False
    """Tensor parallelism moves its collectives (all-reduces; with sequence parallelism all-gathers and
    reduce-scatters) through shared memory where its group stays in one node that has that path
    (``Datacenter.host_memory``: CPU ranks on one host, `isthmus.parallel.shm_collectives`); False:
    over the node's links like every other collective."""
    autocast: bool = False
    """isthmus's mixed precision, what its block keeps in bf16, measured on one block (saved-tensor
    hooks, ``benchmarks/peak_memory.py --block``, exact to the byte but each norm's rsqrt and
    attention's log-sum-exp). Where FSDP2 holds the weights, bf16 computes through its mixed
    precision (bf16 weights gathered over fp32 shards): the block keeps the lean accounting's
    tensors in bf16, and the gathered bf16 weights sit beside the fp32 shards. Elsewhere (one
    process, DDP, ZeRO-1) under ``torch.autocast`` over fp32 weights: each RMSNorm's fp32 input, a
    bf16 copy of its output for every matmul that reads it (wq, wk and wv each cast their own; under
    sequence parallelism of the gathered output), an fp32 residual stream; and autocast's cast
    cache holds a bf16 copy of every weight the rank multiplies by for the whole step, recomputed
    blocks' too (measured with torch.profiler's memory events). False: the block computes in the
    run's dtype throughout (torchtitan's and Megatron's published runs). Only for dtype bf16; an
    fp32 run keeps what ``eager_llama_block`` says."""
    pp_recv_buffers: bool = False
    """torch pipelining's stages keep one receive buffer per microbatch for their input and for their
    output's gradient, allocated once and held between steps (measured: benchmarks/peak_memory.py)."""
    megatron_stages: bool = False
    """Megatron-LM's pipeline rules: layers split evenly over stages (n_layers divisible by pp x v),
    interleaving only with pp > 2 and microbatches divisible by pp."""
    param_overlap: bool | None = None
    """Sharded parameters' all-gathers overlap the forward, block by block (FSDP2's prefetch, Megatron's
    --overlap-param-gather); None: as ``dp_overlap``."""
    tp_overlap: TpOverlap = "none"
    """How tensor-parallel collectives meet the GEMMs next to them. none: each collective waits for its
    GEMM and the GEMM for it (exposed whole). bulk: the backward's collectives run beside the
    independent GEMM of the same layer (Megatron's bulk overlap of dgrad/wgrad): half of a block's
    collectives hidden up to that GEMM's length. pipelined: each collective is split into tp chunks
    that stream under the GEMM consuming or producing them (Megatron's userbuffers ring exchange,
    torchtitan's async TP on SymmetricMemory): only one chunk of each is exposed, or what the GEMM
    cannot cover. Overlapped GEMMs lose :data:`~isthmus.planner.compute.OVERLAP_GEMM_SLOWDOWN` to
    the SMs the transfers take."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """How ``--train.dtype fp8`` scales its GEMM operands (the rest of the block stays bf16):
    tensorwise (one scale per tensor: Transformer Engine's delayed or current scaling, torchao's
    default), rowwise (one per row: torchao), blockwise (1 x 128 and 128 x 128 tiles, DeepSeek-V3's
    recipe), mxfp8 (32-element blocks, Blackwell's MX formats; on Hopper emulated). Each has its own
    GEMM rate and cast traffic (:data:`~isthmus.planner.compute.FP8_RECIPES`)."""
    fused_pointwise: bool = True
    """A block's norms and activation run as fused kernels, one pass over their tensors (Transformer
    Engine, Apex, torch.compile); False: eager PyTorch, whose RMSNorm and SwiGLU run several kernels
    with fp32 intermediates (:data:`~isthmus.planner.compute.EAGER_POINTWISE_TRAFFIC` times the
    traffic). ``train.compile true`` fuses them."""
    fused_cross_entropy: bool = False
    """The loss is computed in vocabulary chunks without the fp32 logits and softmax (Megatron's
    cross-entropy fusion, Liger-style kernels): the last stage keeps its logits in the compute dtype
    only."""
    expert_imbalance: float = 1.05
    """MoE layers: tokens the most loaded expert receives over the mean (1.0: perfect balance). A rank
    of an ep group holding k experts carries 1 + (imbalance - 1) / sqrt(k) times its share (loads
    taken as independent), and the all-to-all waits for it; one rank holding every expert (ep 1) is
    balanced. 1.05 from Megatron's MoE model zoo (best_practice/Mixtral): Mixtral 8x22B with a trained
    router (aux loss) ran at about 455 TFLOP/s per H100 dropless and 470 with every expert padded to a
    capacity factor of 1, a 3.2% loss this model gives at 1.05 on that layout (docs/moe-planning.md).
    Fine-grained routers lose more (the same zoo: 8 to 20% for Qwen3-235B-A22B). A capacity factor
    caps it (model.capacity_factor); ``--expert-imbalance`` sets it for one plan."""
    compress_ratio: float = 0.25
    """Bytes sent over the WAN by the 'compressed' strategy, relative to the gradient's own bytes."""
    # Flat's steps over the strategy's steps to flat's validation loss, from benchmarks/geo_sync.py's
    # runs (the runs behind each value: dev/LOG.md). Capped at 1.0: one seed's luck should not rank a
    # lossy strategy above a lossless one that is as fast.
    quality: tuple[tuple[str, float], ...] = (("compressed", 0.98), ("diloco", 0.87), ("streaming_diloco", 1.0))
    """Tokens-to-same-loss factor of lossy cross-datacenter strategies (ranking only)."""

    @property
    def gathers_overlap(self) -> bool:
        """Whether sharded parameters' all-gathers overlap the forward (``param_overlap``, else ``dp_overlap``)."""
        return self.dp_overlap if self.param_overlap is None else self.param_overlap

    def with_features(self, **features: object) -> Runtime:
        """This software with some of its :data:`FEATURES` set otherwise; the name says which."""
        if not features:
            return self
        unknown = set(features) - set(FEATURES)
        if unknown:
            raise ValueError(f"not a runtime feature: {', '.join(sorted(unknown))}")
        changed = ",".join(f"{k}={_word(v)}" for k, v in features.items())
        return replace(self, name=f"{self.name}[{changed}]", **features)  # type: ignore[arg-type]

    def feature_words(self, dtype: str) -> list[str]:
        """What this software does, one phrase per feature, as ``isthmus plan`` prints them."""
        words = [
            f"tp_overlap {self.tp_overlap}",
            f"dp_overlap {_word(self.dp_overlap)}",
            f"param_overlap {_word(self.gathers_overlap)}",
            f"attention {self.attention}",
            f"fused_cross_entropy {_word(self.fused_cross_entropy)}",
        ]
        if dtype == "fp8":
            words.append(f"fp8_recipe {self.fp8_recipe}")
        return words

    def quality_of(self, geo: str) -> float:
        return dict(self.quality).get(geo, 1.0)

    def with_compile(self, compiled: bool) -> Runtime:
        """This software as ``train.compile = compiled`` runs it: itself when false; when true, with
        each block compiled by torch.compile, priced as its eager blocks. The model already prices a
        block's pointwise work at a fused kernel's traffic, and a compiled block stores less than an
        eager one but more than ``pointwise_recompute`` assumes (benchmarks/peak_memory.py
        --compile; figures in dev/LOG.md), so eager's storage is kept: a plan that fits eager blocks
        fits compiled ones."""
        return replace(self, name=self.name + COMPILED, fused_pointwise=True) if compiled else self


FEATURES: dict[str, str] = {
    "tp_overlap": "tensor-parallel collectives against their GEMMs: none, bulk or pipelined",
    "dp_overlap": "data-parallel gradient reduction overlaps backward: true or false",
    "param_overlap": "sharded parameters' all-gathers overlap forward: true or false",
    "fp8_recipe": "scaling of --train.dtype fp8: tensorwise, rowwise, blockwise or mxfp8",
    "attention": "flash (fused, no S x S tensor) or materialized",
    "selective": "what activation_checkpoint selective recomputes: alternate_blocks or attention_core",
    "fused_pointwise": "norms and activations as fused kernels (compiled or Transformer Engine): true or false",
    "fused_cross_entropy": "loss without fp32 logits: true or false",
}
"""The runtime's features a user sets one by one (``--runtime.<feature>`` of ``isthmus plan`` and
``simulate``), over the preset ``--runtime`` names."""


def _word(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# isthmus on torch 2.13: SDPA (flash on GPU), no dropout, FSDP2/DDP overlap gradient
# reduction with backward, pipelining isend/irecv, bf16 through FSDP2's mixed precision or autocast.
_ISTHMUS = Runtime(
    "isthmus",
    attention="flash",
    dropout=False,
    dp_overlap=True,
    p2p_async=True,
    scatter_gather=False,
    weight_bytes=4,
    grad_bytes=4,
    optimizer_bytes=8,
    autocast=True,
    pp_recv_buffers=True,
)

_MEGATRON_2021 = Runtime(
    "megatron-2021",
    attention="materialized",
    dropout=True,
    dp_overlap=False,
    p2p_async=False,
    scatter_gather=True,
    weight_bytes=2,
    grad_bytes=2,
    optimizer_bytes=12,
    selective=None,  # both came with Korthikanti et al. 2022 (megatron-2022)
    sequence_parallel=False,
    megatron_stages=True,
)

_MEGATRON_CORE = Runtime(
    "megatron-core",
    attention="flash",
    dropout=False,
    dp_overlap=True,
    p2p_async=True,
    scatter_gather=False,
    weight_bytes=2,
    grad_bytes=4,
    optimizer_bytes=12,
    selective="attention_core",
)

DEFAULT_GPU_RUNTIME = "current"
"""The preset ``isthmus plan`` and ``simulate`` assume on GPU topologies; CPU topologies take ``isthmus``."""

RUNTIMES: dict[str, Runtime] = {
    "isthmus": _ISTHMUS,
    # torchtitan (2024) as its published runs used it: FSDP2 with bf16 mixed precision (blocks compute
    # in bf16 throughout, fp32 sharded master weights and reductions), SDPA flash attention, torch
    # pipelining, every-other-block selective recomputation; its published memory (Llama 3.1 8B on
    # H100 96GB at 82.4 GiB; Llama 2 13B without recomputation on A100 80GB) bounds the leaner storage.
    # Its eager blocks run RMSNorm and SwiGLU unfused; `train.compile true` fuses them.
    "torchtitan": replace(_ISTHMUS, name="torchtitan", autocast=False, fused_pointwise=False),
    # Megatron-LM as in Narayanan et al. 2021: fp16 with fused softmax over a materialised score
    # matrix, dropout 0.1, gradient all-reduce after the last backward, blocking p2p with the
    # scatter/gather optimisation, ZeRO-paper state accounting (2 + 2 + 12 bytes per parameter).
    "megatron-2021": _MEGATRON_2021,
    # Megatron-LM from 2022 (Korthikanti et al. 2022): as 2021, plus sequence parallelism and
    # selective recomputation of the attention core. The data-parallel all-reduce still follows the flush.
    "megatron-2022": replace(_MEGATRON_2021, name="megatron-2022", selective="attention_core", sequence_parallel=True),
    # Megatron-DeepSpeed as MT-NLG 530B (Smith et al. 2022) and BLOOM 176B (BigScience 2022) ran it:
    # Megatron's tensor parallelism inside DeepSpeed's pipeline engine (deepspeed/runtime/pipe/), which
    # runs 1F1B without interleaving (TrainSchedule); partitions each stage's output over the
    # model-parallel ranks and all-gathers it on receipt (engine.py: is_pipe_partitioned =
    # is_model_parallel), i.e. Megatron's scatter/gather; sends and receives one tensor per blocking
    # p2p.send / p2p.recv (broadcast on a 2-rank group before torch 1.8), in TrainSchedule's order;
    # data-parallel all-reduce (or ZeRO-1 reduce-scatter) after the flush (ReduceTiedGrads,
    # ReduceGrads, OptimizerStep close the schedule); 2 + 2 + 12 bytes per parameter.
    "megatron-deepspeed": Runtime(
        "megatron-deepspeed",
        attention="materialized",
        dropout=True,
        dp_overlap=False,
        p2p_async=False,
        scatter_gather=True,
        p2p_rendezvous=True,
        weight_bytes=2,
        grad_bytes=2,
        optimizer_bytes=12,
        selective=None,  # the runs predate selective recomputation and sequence parallelism
        sequence_parallel=False,
        megatron_stages=False,  # DeepSpeed splits blocks by count, unevenly where pp does not divide them
    ),
    # Megatron-Core (MCore 0.8 to 0.12, 2024-25) as NVIDIA's MoE benchmarks run it: bf16 with Transformer
    # Engine's fused attention and no dropout; the distributed optimizer (bf16 weights, fp32 main
    # gradients, fp32 master copy and Adam moments sharded over dp) with --overlap-grad-reduce and
    # --overlap-param-gather; sequence parallelism; interleaved pipelines whose p2p overlaps compute,
    # at any pp (2 included) and with uneven first and last stages (--decoder-first/last-pipeline-num-
    # layers), so not Megatron-LM 2021's stage rules; selective recomputation of the attention core.
    "megatron-core": _MEGATRON_CORE,
    # Today's stacks, the default for GPU clusters: Megatron-Core with Transformer Engine (2025) and
    # torchtitan with torch.compile, Float8 and async TP, as their H100 recipes run: fused attention,
    # no dropout, the distributed optimizer (bf16 weights, fp32 gradients, fp32 master and Adam
    # moments sharded over dp when the layout says parallel.zero_stage 1), gradient reduction and
    # parameter gathers overlapped with compute, tensor-parallel collectives pipelined under their
    # GEMMs, a fused cross-entropy, asynchronous pipeline p2p, uneven stages allowed, selective
    # recomputation of the attention core, fused pointwise kernels.
    "current": replace(
        _MEGATRON_CORE,
        name="current",
        tp_overlap="pipelined",
        fused_cross_entropy=True,
        # Transformer Engine's fused norm-linear and SwiGLU kernels, and torch.compile's partitioner,
        # keep what the GEMMs and attention read and recompute the pointwise results.
        pointwise_recompute=True,
    ),
    # Meta's Llama 3 405B pretraining stack as Dubey et al. 2024 (section 3.3.2) describe it: 4D
    # parallelism with FSDP that shards optimizer state and gradients but keeps the bf16 weights
    # gathered from forward to backward (no reshard after forward); gradients accumulated in fp32
    # over microbatches; asynchronous pipeline p2p; an interleaved schedule; no activation
    # checkpointing at 8K sequences (so no selective variant is claimed); fused attention.
    "llama3": replace(
        _MEGATRON_CORE,
        name="llama3",
        selective=None,
        # The paper trained 8K sequences at tp 8, pp 16 on 80 GB without activation checkpointing,
        # which eager storage cannot hold (96.8 GB on the first rank at 1F1B); storing only what
        # matmuls and attention read is the leanest standard storage, and the one assumption made.
        pointwise_recompute=True,
        gathered_across_microbatches=True,
    ),
}
