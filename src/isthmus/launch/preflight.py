"""Checks that need more than the config itself, run once before any work or process starts."""

from __future__ import annotations

import math
import os
from pathlib import Path

from isthmus.checkpoint.manifest import checkpoint_key
from isthmus.config import JobConfig, synthetic_spec
from isthmus.data.corpus import default_cache_dir, is_bin, load_bin
from isthmus.data.tokenizer import (
    BPE_FILE,
    HF_PREFIX,
    ByteTokenizer,
    PretrainedTokenizer,
    RawTokenizer,
    Tokenizer,
    hf_tokenizer_file,
)
from isthmus.errors import ConfigError, DataError
from isthmus.launch.environ import launcher_world
from isthmus.layout.dims import ParallelDims, check_layout
from isthmus.log import get_logger
from isthmus.models.args import ModelArgs
from isthmus.models.flavors import list_flavors
from isthmus.models.resolve import expected_vocab, resolve_model_args
from isthmus.planner.autoplan import local_runtime
from isthmus.planner.compute import BlockShape
from isthmus.planner.memory import MemoryBreakdown, device_memory
from isthmus.planner.pipeline import in_flight
from isthmus.serve.requests import TOKEN_BYTES, RequestLimits, check_synthetic, iter_request_file
from isthmus.train.membership import cannot_continue


def preflight(cfg: JobConfig) -> ModelArgs:
    """Validate model shape against data, paths and memory before anything is built; returns the model's shape."""
    _check_paths(cfg)
    bin_ids = _bin_max_id(cfg)
    # As the trainer's tokenizer for such a file (`data.corpus.bin_tokenizer`): bytes, or ids up to the largest.
    vocab = expected_vocab(cfg.data) if bin_ids is None else max(256, bin_ids[1] + 1)
    if cfg.data.tokenizer.startswith(HF_PREFIX):
        # A checkpoint's tokenizer: its vocabulary must fit the model's, checked here before any work.
        vocab = PretrainedTokenizer.from_spec(cfg.data.tokenizer).vocab_size
        if bin_ids is not None and bin_ids[1] >= vocab:
            raise DataError(
                f"data.path {bin_ids[0]!r}: largest id {bin_ids[1]:,} is outside data.tokenizer's vocabulary "
                f"({vocab:,}); check data.bin_dtype ({cfg.data.bin_dtype})"
            )
    _warn_other_tokenizer(cfg)
    if bin_ids is not None and cfg.model.vocab_size is not None and bin_ids[1] >= cfg.model.vocab_size:
        raise DataError(
            f"data.path {bin_ids[0]!r}: largest id {bin_ids[1]:,} is not below model.vocab_size = {cfg.model.vocab_size:,}; "
            f"check data.bin_dtype ({cfg.data.bin_dtype}) or raise model.vocab_size"
        )
    args = resolve_model_args(cfg.model, vocab)

    world = launcher_world()
    if cfg.geo.fault_tolerant:
        # torchft (optional, and it loads torch): only for a fault-tolerant run, which needs it anyway.
        from isthmus.geo.fault import check_config, layout_world

        check_config(cfg.geo)
        # Each datacenter is its own job: the layout spans every datacenter's ranks.
        world = layout_world(cfg.geo, world or cfg.parallel.nproc)
    try:
        dims = check_layout(
            cfg,
            args.n_heads,
            args.n_kv_heads,
            args.n_layers,
            world_size=world,
            n_experts=args.n_experts,
            capacity_factor=args.capacity_factor,
        )
    except ConfigError as e:
        if world is None:
            raise
        # Under torchrun: an elastic job that restarted on fewer hosts than its layout needs.
        raise cannot_continue(e, Path(cfg.train.run_dir), world) from None
    if cfg.geo.wan_schedule == "time_shared" and (cfg.geo.dc_axis != "pp" or cfg.geo.datacenters == 1):
        # Only pipeline stages in different datacenters have WAN transfers to take turns with.
        raise ConfigError(
            "geo.wan_schedule",
            cfg.geo.wan_schedule,
            "needs pipeline stages across datacenters (geo.dc_axis = pp, geo.datacenters > 1)",
        )
    if cfg.geo.pp_compression == "lowrank" and cfg.geo.pp_compression_rank > args.dim:
        # A rank of dim or more sends more than the tensor (geo.pp_compression_rank >= 1 is in validate_geo).
        raise ConfigError(
            "geo.pp_compression_rank", cfg.geo.pp_compression_rank, f"must be between 1 and model.dim = {args.dim}"
        )
    if cfg.model.tie_embeddings and cfg.parallel.pp > 1:
        raise ConfigError(
            "model.tie_embeddings",
            True,
            "cannot be combined with parallel.pp > 1 (embedding and head live on different stages)",
        )
    on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not _cuda_visible())
    if on_cpu:
        _check_fits_in_memory(cfg, args, dims, bin_ids)
        if cfg.train.compile:
            from isthmus.parallel.compile import check_cpu_toolchain  # loads torch: only for a compiled run

            check_cpu_toolchain()
    # After the run's own memory check: the requests get what the run leaves of this machine's memory.
    _check_bubbles(cfg, vocab, bin_ids is not None, args, dims, on_cpu)

    # The key signs checkpoints and the final model: an unreadable or short one stops here, before any process starts.
    checkpoint_key(cfg.checkpoint.key_file)
    return args


def _check_bubbles(
    cfg: JobConfig, vocab: int | None, bin_data: bool, args: ModelArgs, dims: ParallelDims, on_cpu: bool
) -> None:
    """bubbles.model names a flavor, and bubbles.prefill's requests fit: each in the serving model's
    context (train.seq_len), all of them in the memory the run leaves on this machine (every local
    rank holds them all; a run on CPU takes its estimate first), every id below the tokenizer's
    vocabulary (which the serving model shares)."""
    b = cfg.bubbles
    if not b.prefill:
        return
    if b.model and b.model not in list_flavors():
        raise ConfigError("bubbles.model", b.model, f"must be empty or a flavor: {', '.join(list_flavors())}")
    if cfg.geo.wan_schedule == "time_shared":
        # The filler waits on a receive from a helper thread, and a time-shared receive passes the
        # link's token inside that wait: the token's collectives would run off the main thread, in an
        # order no rank agrees on. Not built; refused rather than left to hang.
        raise ConfigError("bubbles.prefill", b.prefill, "cannot be combined with geo.wan_schedule = time_shared (yet)")
    ram = _physical_memory()
    ranks = cfg.parallel.nproc
    run = _local_need(estimate_rank_memory(cfg, args, dims), ranks) if on_cpu else 0.0
    limits = RequestLimits(
        max_tokens=cfg.train.seq_len,
        max_total_tokens=max(0, int((ram - run) // (TOKEN_BYTES * ranks))),
        total_rule=(
            f"each of the {ranks} local rank(s) holds every request ({TOKEN_BYTES} bytes a token) in what this "
            f"machine's {_gib(ram)} leaves after the run's {_gib(run)}; serve fewer requests per run"
        ),
    )
    spec = synthetic_spec(b.prefill)
    if spec is not None:
        check_synthetic(b.prefill, *spec, limits)
        return
    tokenizer = _prompt_tokenizer(cfg, vocab, bin_data)
    count = (lambda text: len(tokenizer.encode(text))) if tokenizer is not None else None
    for _ in iter_request_file(Path(b.prefill), vocab or 256, limits, count):
        pass


def _prompt_tokenizer(cfg: JobConfig, vocab: int | None, bin_data: bool) -> Tokenizer | None:
    """The tokenizer the ranks will encode prompts with, where it is known before they start (not a
    BPE, which rank 0 trains on the corpus)."""
    if bin_data:
        assert vocab is not None
        return ByteTokenizer() if vocab <= 256 else RawTokenizer(vocab)
    if cfg.data.tokenizer.startswith(HF_PREFIX):
        return PretrainedTokenizer.from_spec(cfg.data.tokenizer)
    return ByteTokenizer() if cfg.data.tokenizer == "byte" else None


def _cuda_visible() -> bool:
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES", "")) or os.path.exists("/dev/nvidia0")


# --- paths ---------------------------------------------------------------------------------------
def _warn_other_tokenizer(cfg: JobConfig) -> None:
    """One warning when model.init_from's folder has a tokenizer.json the run does not use: the
    tokenizer is named by data.tokenizer alone (one name per setting), so a fine-tune on byte ids
    is allowed, but rarely meant."""
    init = Path(cfg.model.init_from) if cfg.model.init_from else None
    if init is None or not (init / BPE_FILE).is_file():
        return
    tok = cfg.data.tokenizer
    if tok.startswith(HF_PREFIX) and hf_tokenizer_file(tok).resolve() == (init / BPE_FILE).resolve():
        return
    get_logger().warning(
        "model.init_from %s has its own %s, but data.tokenizer = %r; pass --data.tokenizer hf:%s to use it",
        init,
        BPE_FILE,
        tok,
        init,
    )


def _check_paths(cfg: JobConfig) -> None:
    """Every folder the run writes to can take new files; checked on the nearest folder that exists."""

    t, c, m = cfg.train, cfg.checkpoint, cfg.metrics
    _check_writable("train.run_dir", t.run_dir, Path(t.run_dir))
    if c.dir:
        _check_writable("checkpoint.dir", c.dir, Path(c.dir))
    if m.jsonl:
        if Path(m.jsonl).is_dir():
            raise ConfigError("metrics.jsonl", m.jsonl, "is a folder; name a file")
        _check_writable("metrics.jsonl", m.jsonl, Path(m.jsonl).parent)
    _check_writable("data.cache_dir", cfg.data.cache_dir, default_cache_dir(cfg.data))


def _check_writable(key: str, value: str, folder: Path) -> None:
    """``folder`` (where ``key = value`` writes), or the nearest folder above it when it does not exist yet, takes new files."""
    existing = folder
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(key, value, f"{existing} is a file, not a folder")
    except OSError as e:
        raise ConfigError(key, value, f"cannot be read ({e.strerror or e})") from None
    # os.access also sees a read-only file system, which permission bits do not show (and root ignores).
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            key,
            value,
            f"{existing} is not writable" + ("" if existing == folder else " (the folder would be made there)"),
        )


# --- memory ----------------------------------------------------------------------------------------
PROCESS_BASELINE_BYTES = 0.3 * 2**30
"""What one rank holds before its model: the Python interpreter, torch and its allocator (the
resident memory of a tiny run's rank, rounded up; dev/LOG.md)."""


def _bin_max_id(cfg: JobConfig) -> tuple[str, int] | None:
    """(path, largest id) of a pre-tokenised data file, read once before any process starts.

    The model's vocabulary follows the largest id when model.vocab_size is unset, so one wrong id (or
    the wrong data.bin_dtype) would otherwise ask for an embedding of billions of rows.
    """

    if not is_bin(cfg.data):
        return None
    tokens = load_bin(cfg.data)
    return cfg.data.path, int(tokens.max())


def estimate_rank_memory(cfg: JobConfig, args: ModelArgs, dims: ParallelDims) -> MemoryBreakdown:
    """Peak bytes of one rank: the planner's model-state and activation accounting (`planner.memory`).

    Activations per block follow Korthikanti et al. 2022 with fused attention (no S x S matrix: torch's
    SDPA on CPU and flash attention on GPU), for the sequences one rank holds at once: train.batch_size
    / data-parallel degree / train.grad_accum (/ parallel.microbatches under a pipeline, times those in
    flight), plus the fp32 logits over the vocabulary. It counts what must exist, not allocator slack,
    so it is a lower bound: a run it refuses cannot fit.
    """

    p, t = cfg.parallel, cfg.train
    sequences = t.batch_size / dims.dp / t.grad_accum
    micro = math.ceil(sequences / p.microbatches if dims.pp > 1 else sequences)
    layers = math.ceil(args.n_layers / dims.pp)
    shard = dims.dp_shard * dims.cp if dims.dp_shard > 1 else 1
    worst: MemoryBreakdown | None = None
    for first, last in ((True, dims.pp == 1), (False, True)) if dims.pp > 1 else ((True, True),):
        m = device_memory(
            BlockShape(args, micro, t.seq_len, dims.tp, dims.cp, p.sequence_parallel, t.dtype),
            local_runtime(),  # CPU ranks: this check runs only for them
            layers=layers,
            first=first,
            last=last,
            pp=dims.pp,
            activation_checkpoint=p.activation_checkpoint,
            in_flight=in_flight(p.pp_schedule, dims.pp, p.pp_virtual_stages, p.microbatches),
            zero_stage=p.zero_stage,
            shard=shard,
            accumulate=t.grad_accum > 1,
            microbatches=p.microbatches,
            virtual_stages=p.pp_virtual_stages if dims.pp > 1 else 1,
        )
        if worst is None or m.total > worst.total:
            worst = m
    assert worst is not None
    return worst


def _check_fits_in_memory(cfg: JobConfig, args: ModelArgs, dims: ParallelDims, bin_ids: tuple[str, int] | None) -> None:
    """Refuse a run whose local ranks cannot fit in this machine's memory, naming the key to change.

    All local ranks share the machine. Model state (fp32 weights and gradients, two AdamW moments,
    sharded by ZeRO as FSDP2 runs it, divided by tp and pp) decides first; then activations.
    """
    ram = _physical_memory()
    m = estimate_rank_memory(cfg, args, dims)
    ranks = cfg.parallel.nproc
    state = (m.weights + m.grads + m.optimizer) * ranks
    need = _local_need(m, ranks)
    if need <= ram:
        return
    one_rank = (m.weights + m.grads + m.optimizer) + PROCESS_BASELINE_BYTES
    if ranks > 1 and one_rank <= ram and state + PROCESS_BASELINE_BYTES * ranks > ram:
        # One rank fits; it is their number that does not (each is a whole Python process with torch).
        raise ConfigError(
            "parallel.nproc",
            ranks,
            f"{ranks} ranks need about {_gib(state + PROCESS_BASELINE_BYTES * ranks)} on this machine's {_gib(ram)} "
            f"(each {_gib(PROCESS_BASELINE_BYTES)} for its process and {_gib(state / ranks)} of model state); "
            f"start at most {int(ram // one_rank)} here",
        )
    if state + PROCESS_BASELINE_BYTES * ranks > ram:
        if bin_ids is not None and cfg.model.vocab_size is None:
            path, max_id = bin_ids
            raise DataError(
                f"data.path {path!r}: largest id {max_id:,} makes a vocabulary of {max_id + 1:,} tokens; the model would "
                f"need about {_gib(state)} for weights, gradients and optimizer state on this machine's "
                f"{_gib(ram)}: set model.vocab_size, or check data.bin_dtype ({cfg.data.bin_dtype})"
            )
        # With model.init_from the weights' own shape is what does not fit, not the flavor.
        source = ("model.init_from", cfg.model.init_from) if cfg.model.init_from else ("model.flavor", cfg.model.flavor)
        raise ConfigError(
            *source,
            f"needs about {_gib(state)} for weights, gradients and optimizer state on this machine's "
            f"{_gib(ram)}; use `isthmus plan` for large models or a smaller flavor",
        )
    t = cfg.train
    sequences = t.batch_size // dims.dp
    key, value = ("train.seq_len", t.seq_len) if t.seq_len >= sequences else ("train.batch_size", t.batch_size)
    raise ConfigError(
        key,
        value,
        f"needs about {_gib(need)} on this machine's {_gib(ram)} ({ranks} rank(s), each "
        f"{_gib(m.activations + m.transient)} of activations for {sequences} sequence(s) of {t.seq_len} tokens "
        f"and {_gib(m.weights + m.grads + m.optimizer)} of model state); lower train.seq_len or "
        "train.batch_size, raise train.grad_accum, or set parallel.activation_checkpoint = full",
    )


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _local_need(m: MemoryBreakdown, ranks: int) -> float:
    """Bytes the run's ranks on this machine need together: each rank's estimate and its process."""
    return (m.total + PROCESS_BASELINE_BYTES) * ranks


def _gib(n: float) -> str:
    g = n / 2**30
    return f"{g:,.0f} GiB" if g >= 10 else f"{g:.2g} GiB"
