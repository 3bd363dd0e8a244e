"""Checks that need more than the config itself, run once before any work or process starts."""

from __future__ import annotations

from isthmus.config import JobConfig
from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs
from isthmus.models.resolve import resolve_model_args


def expected_vocab(cfg: JobConfig) -> int | None:
    """The tokenizer vocabulary known before reading data (None for pre-tokenised files)."""
    d = cfg.data
    if d.format == "bin" or (d.format == "auto" and d.path.endswith(".bin")):
        return None
    return 256 if d.tokenizer == "byte" else d.bpe_vocab_size


def preflight(cfg: JobConfig) -> ModelArgs:
    """Validate model shape against data before anything is built; returns the model's shape."""
    vocab = expected_vocab(cfg)
    args = resolve_model_args(cfg.model, vocab)
    import os

    from isthmus.parallel.dims import check_layout

    world = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None
    if cfg.geo.fault_tolerant:
        from isthmus.geo.fault import check_config, layout_world

        check_config(cfg.geo)
        # Each datacenter is its own job: the layout spans every datacenter's ranks.
        world = layout_world(cfg.geo, world or cfg.parallel.nproc)
    check_layout(cfg, args.n_heads, args.n_kv_heads, args.n_layers, world_size=world)
    if cfg.model.tie_embeddings and cfg.parallel.pp > 1:
        raise ConfigError("model.tie_embeddings", True, "cannot be combined with parallel.pp > 1 (embedding and head live on different stages)")
    if cfg.train.device == "cpu" or (cfg.train.device == "auto" and not _cuda_visible()):
        _check_fits_in_memory(cfg, args)
    from isthmus.train.checkpoint_manifest import checkpoint_key

    # The key signs checkpoints and the final model: an unreadable or short one stops here, before any process starts.
    checkpoint_key(cfg.checkpoint.key_file)
    return args


def _cuda_visible() -> bool:
    import os

    return bool(os.environ.get("CUDA_VISIBLE_DEVICES", "")) or os.path.exists("/dev/nvidia0")


def _check_fits_in_memory(cfg: JobConfig, args: ModelArgs) -> None:
    """fp32 weights, gradients and two AdamW moments per parameter; refuse what cannot fit.

    Per rank, as measured by benchmarks/zero_memory.py: ZeRO-1 shards only the 8 optimizer bytes,
    ZeRO-2 also the gradients but holds full weights during the step, ZeRO-3 shards everything;
    tensor and pipeline parallelism divide all of it.
    """
    import os

    from isthmus.models.flops import count_params

    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    p = cfg.parallel
    n = p.dp_shard
    per_param = {1: 4 + 4 + 8 / n, 2: 4 + 4 / n + 8 / n + 4 / n, 3: 16 / n}[p.zero_stage] if n > 1 else 16.0
    # All local ranks share this machine's memory.
    need = per_param * count_params(args) / (p.tp * p.pp) * p.nproc
    if need > ram:
        raise ConfigError(
            "model.flavor", cfg.model.flavor,
            f"needs about {need / 2**30:.0f} GiB for weights, gradients and optimizer state on this machine's "
            f"{ram / 2**30:.0f} GiB; use `isthmus plan` for large models or a smaller flavor",
        )
