"""The job configuration: typed sections, TOML files, ``--section.key VALUE`` overrides.

Precedence is defaults < TOML file < command line. The config is built and validated once, up
front, before any process starts; every problem a user can cause is a :class:`ConfigError` whose
one line names the key, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from isthmus.errors import ConfigError
from isthmus.layout.choices import ActivationCheckpoint, CpImpl, PpSchedule, SyncKind, WanSchedule
from isthmus.layout.plan import is_plan_file, plan_overrides

RUN_DIR_PLACEHOLDERS = ("{config}", "{time}")
"""What train.run_dir may hold: the config's name and the run's start time (see isthmus.launch.rundir)."""


@dataclass
class ModelConfig:
    """The model's shape: a named flavor, any field of it overridden, or pretrained weights."""

    flavor: str = "small"
    """Named model shape (see `isthmus.models.flavors`): tiny, small, llama3-8b, gpt3-1.7b, ..."""
    n_layers: int | None = None
    """Override the flavor's number of transformer blocks."""
    dim: int | None = None
    """Override the flavor's hidden size."""
    n_heads: int | None = None
    """Override the flavor's number of attention heads."""
    n_kv_heads: int | None = None
    """Override the flavor's number of key/value heads (grouped-query attention)."""
    ffn_dim: int | None = None
    """Override the flavor's MLP hidden size."""
    vocab_size: int | None = None
    """Override the vocabulary size (must cover the tokenizer's vocabulary)."""
    mlp: Literal["swiglu", "gelu"] | None = None
    """Override the MLP kind: swiglu (Llama) or gelu (GPT)."""
    tie_embeddings: bool | None = None
    """Override whether input embedding and output head share weights."""
    norm_eps: float | None = None
    """Override the flavor's RMSNorm epsilon (1e-5 unless the flavor says otherwise)."""
    rope_theta: float | None = None
    """Override the flavor's rotary base (10000; 500000 for Llama 3)."""
    n_experts: int | None = None
    """Override the routed experts per Mixture-of-Experts layer (0 = a dense model; the moe-* flavors set it)."""
    top_k: int | None = None
    """Override the routed experts each token goes to (2 unless the flavor says otherwise)."""
    moe_ffn_dim: int | None = None
    """Override the hidden size of each routed and shared expert (0 = model.ffn_dim)."""
    n_shared_experts: int | None = None
    """Override the always-on experts (one SwiGLU of width n_shared_experts * the expert width)."""
    n_dense_layers: int | None = None
    """Override how many first blocks keep the dense MLP instead of experts."""
    router_score: Literal["softmax", "sigmoid"] | None = None
    """Override the router's score function over the experts: softmax or sigmoid."""
    router_norm_topk: bool | None = None
    """Override whether each token's top-k expert weights are renormalised to sum to 1."""
    capacity_factor: float | None = None
    """Experts take at most ceil(capacity_factor * tokens * top_k / n_experts) of the tokens each rank routes,
    the rest are dropped (the residual passes); 0 = dropless, the default."""
    load_balance: Literal["aux_loss", "bias", "none"] | None = None
    """How experts are kept evenly loaded: aux_loss (Switch/GShard auxiliary loss, the default), bias (a per-expert
    bias on the selection scores, updated after each step; arXiv 2408.15664) or none."""
    aux_loss_coef: float | None = None
    """Weight of the auxiliary load-balancing loss in the training loss (0.01 unless the flavor says otherwise)."""
    bias_update_rate: float | None = None
    """Step of the bias method's per-expert update after each optimizer step (0.001 unless the flavor says
    otherwise)."""
    attn_head_dim: int | None = None
    """Override the width of each attention head (0 = dim // n_heads; Qwen3's heads are wider)."""
    qk_norm: bool | None = None
    """Override whether each head's queries and keys are RMS-normalised before RoPE (Qwen3)."""
    init_from: str = ""
    """Start from these weights: a Hugging Face Llama, Qwen3, Mixtral or Qwen3-MoE folder, or a file
    `isthmus export` wrote; its shape replaces the flavor's. Empty = a fresh seeded init."""


@dataclass
class DataConfig:
    """The text the model trains on and how it becomes tokens."""

    path: str = ""
    """Text file, folder of text files, or pre-tokenised .bin file; empty = the Python standard library's source."""
    format: Literal["auto", "text", "bin"] = "auto"
    """How to read data.path: auto (.bin files are pre-tokenised), text, or bin."""
    bin_dtype: Literal["uint16", "uint32"] = "uint16"
    """Token dtype of a pre-tokenised .bin file."""
    tokenizer: str = "byte"
    """Tokenizer: byte (UTF-8 bytes), bpe (trained locally and cached), or hf:PATH, a checkpoint's
    tokenizer.json (PATH: its folder or the file); each document is then BOS + text + EOS (those the
    checkpoint's tokenizer_config.json / special_tokens_map.json / config.json name). Named even with
    model.init_from: the default stays byte."""
    bpe_vocab_size: int = 4096
    """Vocabulary size when training a BPE tokenizer."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of text (0 = no limit)."""
    val_fraction: float = 0.05
    """Fraction of the tokens held out for validation."""
    cache_dir: str = ""
    """Where tokenised corpora and BPE tokenizers are cached; empty = ~/.cache/isthmus."""


@dataclass
class TrainConfig:
    """The optimizer, the batch, precision and the run's directory."""

    steps: int = 300
    """Number of optimizer steps."""
    seed: int = 0
    """Seed for initialisation and data order; the same seed gives the same losses."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of train.lr."""
    warmup_steps: int = 20
    """Linear warm-up steps before cosine decay."""
    weight_decay: float = 0.1
    """AdamW weight decay (not applied to norms and embeddings)."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    batch_size: int = 16
    """Global batch: sequences per optimizer step, over all data-parallel ranks."""
    seq_len: int = 128
    """Tokens per sequence."""
    grad_accum: int = 1
    """Forward/backward passes accumulated per optimizer step (gradient accumulation); under a pipeline,
    each runs parallel.microbatches microbatches."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Compute dtype: fp32, or bf16 over fp32 parameters: FSDP2's mixed precision where FSDP holds the
    weights (bf16 gathered, fp32 reductions), torch.autocast elsewhere."""
    compile: bool = False
    """Compile each transformer block and the loss with torch.compile (inductor; on CPU it needs a C++
    compiler): fused elementwise work, faster steps; the first step pays the compilation (tens of
    seconds on CPU, cached on disk for later runs)."""
    val_every: int = 50
    """Validate every N steps (0 = only at the end)."""
    val_batches: int = 8
    """Batches of train.batch_size sequences per validation."""
    run_dir: str = "runs/{config}-{time}"
    """This run's directory (config, logs, metrics, checkpoints, final model); {config} and {time} make a fresh one per run."""
    overwrite: bool = False
    """Replace what an earlier run left in train.run_dir (and checkpoint.dir) instead of refusing to start."""
    device: str = "auto"
    """Device: auto (cuda when available, else cpu), cpu or cuda."""
    threads: int = 0
    """torch intra-op threads per process (0 = torch's default)."""


@dataclass
class ParallelConfig:
    """The layout: how many local ranks, and how the model and batch are split over them."""

    nproc: int = 1
    """Local processes (ranks) to start; 1 trains in this process."""
    dp_replicate: int = -1
    """Replicated data-parallel degree (DDP); -1 = what the other degrees leave of parallel.nproc."""
    dp_shard: int = 1
    """Sharded data-parallel degree (ZeRO / FSDP); -1 = what the other degrees leave (fills before dp_replicate)."""
    zero_stage: int = 3
    """What dp_shard shards: 1 optimizer state, 2 + gradients, 3 + parameters."""
    tp: int = 1
    """Tensor-parallel degree."""
    sequence_parallel: bool = False
    """Shard norms and dropout regions along the sequence inside the tensor-parallel group."""
    cp: int = 1
    """Context-parallel degree."""
    cp_impl: CpImpl = "ring"
    """Context-parallel attention: ring (online softmax) or ulysses (all-to-all)."""
    ep: int = 1
    """Expert-parallel degree of MoE layers, folded over dp_shard x cp (it must divide them): each of its
    ranks holds n_experts / ep experts and exchanges tokens with the others by all-to-all."""
    pp: int = 1
    """Pipeline-parallel degree."""
    pp_schedule: PpSchedule = "1f1b"
    """Pipeline schedule."""
    microbatches: int = 1
    """A pipeline's microbatches per step (needs parallel.pp > 1; gradient accumulation is train.grad_accum)."""
    pp_virtual_stages: int = 1
    """Pipeline stages per rank (interleaved schedules need 2 or more)."""
    activation_checkpoint: ActivationCheckpoint = "none"
    """Activation recomputation: none, full (every block) or selective (every other block)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend: auto picks nccl on CUDA, gloo on CPU."""
    max_restarts: int = 0
    """Restart all ranks up to N times when one dies; they resume from the newest good checkpoint."""
    timeout_s: int = 300
    """Seconds a rank may stop answering (or, once training runs, wait in a collective) before the run is stopped."""
    plan: str = "manual"
    """manual: the degrees above; auto: the planner chooses them for parallel.nproc local ranks (keys given on the command line stay fixed); a file written by isthmus plan --json: its best layout's keys replace the config file's (keys given on the command line win)."""
    plan_topology: str = "local"
    """What parallel.plan auto plans for: the local preset or a file written by isthmus profile."""


@dataclass
class CheckpointConfig:
    """Resumable checkpoints: when to save, how many to keep, where to resume from, signing."""

    dir: str = ""
    """Checkpoint directory; empty = <train.run_dir>/checkpoints."""
    every: int = 0
    """Save a resumable checkpoint every N steps and after the last one (0 = only the final model)."""
    keep: int = 2
    """Keep the newest N checkpoints; older ones are deleted after each save."""
    resume: str = "none"
    """none (start fresh), auto (the newest good checkpoint in checkpoint.dir, else fresh), or a checkpoint's path."""
    async_save: bool = False
    """Write checkpoints in the background while training continues (the state is copied to memory first)."""
    key_file: str = ""
    """Secret key file: sign checkpoints and the final model (HMAC-SHA256), load only signed ones; "" = $ISTHMUS_CHECKPOINT_KEY_FILE."""


@dataclass
class MetricsConfig:
    """What a run logs: console lines, one JSON record per step, TensorBoard, a timeline trace."""

    jsonl: str = ""
    """Write one JSON record per step (and per validation) to this file; empty = <run_dir>/metrics.jsonl."""
    log_every: int = 10
    """Log a line to the console every N steps."""
    tensorboard: bool = False
    """Also write TensorBoard events to <run_dir>/tb (needs the tensorboard extra)."""
    progress: bool = True
    """Show a progress bar on an interactive console."""
    timeline: str = ""
    """Write every rank's busy/idle timeline (training ops, P2P waits, bubble prefill chunks) to this Chrome / Perfetto trace file (open in ui.perfetto.dev), and log each rank's busy fraction per step; "" = off."""


@dataclass
class BubblesConfig:
    """Inference prefill served in a pipeline's idle time (its bubbles)."""

    prefill: str = ""
    """Prefill requests to run in the pipeline's bubbles: a JSONL file ({"id": ..., "prompt": "text"} or "tokens": [ids] per line) or synthetic:N:LEN (N prompts of LEN random tokens, seeded by train.seed); each request at most train.seq_len tokens; outputs go to <run_dir>/prefill.jsonl; "" = off."""
    model: str = ""
    """The model that serves the prefill requests (a frozen copy on every pipeline rank): "" = the run's own model at the weights it starts from (model.init_from, else train.seed's initialisation), or a flavor name (initialised from train.seed, the tokenizer's vocabulary)."""


WireDtype = Literal["fp32", "bf16", "int8", "int4"]
OuterWire = Literal["fp32", "bf16", "int8", "int4", "topk2"]
"""What the outer gradients of diloco and streaming_diloco go on the WAN as (topk2: isthmus.geo.sparse)."""
OuterDtype = Literal["auto", "fp32", "bf16", "int8", "int4", "topk2"]


WAN_STREAMS_MAX = 16
"""The most connections one cross-datacenter transfer is split over (``geo.wan_streams``)."""


@dataclass
class GeoConfig:
    """Datacenters: how ranks split into them and what crosses the WAN between them."""

    sync: SyncKind = "none"
    """Cross-datacenter sync: none, flat, hierarchical, compressed, diloco or streaming_diloco."""
    datacenters: int = 1
    """Datacenters the data-parallel ranks are split into, equally: rank = dc * ranks_per_dc + local."""
    dc_axis: Literal["dp", "pp"] = "dp"
    """What the datacenters split: dp (replicas, geo.sync crosses the WAN) or pp (consecutive pipeline stages: activations cross the WAN, gradients stay inside)."""
    wan_dtype: Literal["int8", "int4"] = "int8"
    """compressed: dtype of gradient shards on the WAN hop (per-block absmax scales, fp32)."""
    block_size: int = 256
    """Elements per quantisation block (one fp32 scale each); even, so int4 packs two per byte."""
    error_feedback: bool = True
    """Add each rank's quantisation error to the next value it quantises (compressed and quantised outer gradients)."""
    bucket_mb: int = 25
    """Largest flat fp32 buffer per collective, in MiB (one parameter larger than this gets its own)."""
    inner_steps: int = 50
    """diloco / streaming_diloco: inner optimizer steps H between two syncs of the same parameters."""
    outer_lr: float = 1.0
    """diloco / streaming_diloco: outer Nesterov SGD learning rate. 1 with no momentum: the snapshot becomes the datacenters' mean, which trained best in benchmarks/geo_sync.py's runs (dev/LOG.md); the DiLoCo paper's 0.7 with momentum 0.9 is for hundreds of inner steps."""
    outer_momentum: float = 0.0
    """diloco / streaming_diloco: outer Nesterov momentum (0 = plain SGD; the DiLoCo paper: 0.9)."""
    fragments: int = 4
    """streaming_diloco: parameter fragments synchronised in turn, staggered by inner_steps // fragments."""
    overlap_steps: int = 1
    """streaming_diloco: inner steps tau between launching a fragment's transfer and applying its result."""
    wan_schedule: WanSchedule = "fair"
    """dc_axis = pp: how the pipelines crossing one WAN link share it: fair (all at once, what the runtime's sends do) or time_shared (in turn, in replica order, staggered by one transfer)."""
    mix_alpha: float = 0.5
    """streaming_diloco: fragment <- alpha * local + (1 - alpha) * global when applied (0 = replace by global)."""
    eager: bool = False
    """diloco / streaming_diloco: eager outer updates (Kale et al. 2025): a fragment's outer step is taken as it syncs, from this datacenter's fresh outer gradient and the other datacenters' of the previous sync, whose transfer had the H steps since to cross the WAN (overlap_steps unused)."""
    outer_dtype: OuterDtype = "auto"
    """diloco / streaming_diloco: outer-gradient dtype on the WAN; auto = fp32 for diloco, int4 for streaming; topk2 = SparseLoCo's top-k of each block_size chunk at 2 bits (outer_density)."""
    outer_density: float = 0.02
    """outer_dtype topk2: fraction of each chunk's entries sent, largest magnitudes first (round(outer_density * block_size) a chunk, at least 1); the rest stay in the error feedback."""
    feedback_decay: float = 1.0
    """diloco / streaming_diloco, lossy outer_dtype: the error feedback becomes feedback_decay * residual + outer gradient before each encoding (1 = keep all that was not sent; SparseLoCo's beta, e.g. 0.95, lets it fade)."""
    pp_compression: Literal["none", "int8", "int4", "lowrank"] = "none"
    """dc_axis = pp: what activations and their gradients cross a pipeline boundary between datacenters as: none (exact), int8 or int4 (per-token absmax, one fp32 scale a token) or lowrank (a rank-pp_compression_rank projection, `isthmus.parallel.boundary_codec`); boundaries inside a datacenter stay exact."""
    pp_compression_rank: int = 32
    """pp_compression lowrank: the rank r of the projection, (tokens + dim) * r values a boundary tensor (1 to model.dim)."""
    pp_early_recv: bool = False
    """dc_axis = pp, wan_schedule fair: post a step's receives from another datacenter when its first one is asked for, so the receiver's notice crosses the WAN while the sender computes (gloo sends a payload only against a posted receive); results are bit-identical."""
    wan_streams: int = 1
    """Parallel connections per cross-datacenter transfer (pipeline sends and receives across datacenters, geo.sync's inter-datacenter collectives): each transfer is split into this many stripes, one per connection, reassembled exactly. One TCP flow carries at most its window / RTT."""
    fault_tolerant: bool = False
    """diloco / streaming_diloco: each datacenter is its own torch.distributed job and the outer step goes through torchft (a lighthouse at TORCHFT_LIGHTHOUSE): a datacenter that dies is dropped from the quorum, one that restarts rejoins from the current global model."""


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    geo: GeoConfig = field(default_factory=GeoConfig)
    bubbles: BubblesConfig = field(default_factory=BubblesConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self) -> str:
        """The resolved config as TOML (None values, i.e. 'use the flavor's', are omitted)."""
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for key, value in values.items():
                if value is not None:
                    lines.append(f"{key} = {_toml_value(value)}")
            lines.append("")
        return "\n".join(lines)


RESUME_MAY_CHANGE = (
    "parallel.",
    "geo.",
    "checkpoint.",
    "metrics.",
    "bubbles.",
    "train.steps",
    "train.run_dir",
    "train.overwrite",
    "train.val_every",
    "train.val_batches",
    "train.threads",
    "train.device",
    "train.compile",
    "data.cache_dir",
)
"""Settings a run may change when it continues from its checkpoint: the layout (checkpoints reshard),
how long it trains, where and how it logs. Everything else (model, data, optimizer, batch) defines the run."""


def settings_that_differ(
    saved_toml: str,
    current_toml: str,
    may_change: tuple[str, ...] = RESUME_MAY_CHANGE,
    saved_model: dict[str, Any] | None = None,
    current_model: dict[str, Any] | None = None,
) -> list[str]:
    """``key: saved -> current`` for every setting (outside ``may_change``) where two resolved configs differ.

    ``saved_model`` and ``current_model`` are the model shapes each config resolved to (`ModelArgs`
    fields): a ``[model]`` key left to the flavor is compared, and shown, as its resolved value, since
    the TOML omits it."""

    def flat(text: str) -> dict[str, Any]:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError:
            return {}
        return {
            f"{section}.{key}": value
            for section, values in data.items()
            if isinstance(values, dict)
            for key, value in values.items()
        }

    def resolved(values: dict[str, Any], model: dict[str, Any] | None) -> dict[str, Any]:
        return {**{f"model.{k}": v for k, v in (model or {}).items()}, **values}

    saved, current = resolved(flat(saved_toml), saved_model), resolved(flat(current_toml), current_model)
    keys = sorted(set(saved) | set(current))
    return [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in keys
        if not k.startswith(may_change) and saved.get(k) != current.get(k)
    ]


_TOML_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return toml_string(str(value))


def toml_string(text: str) -> str:
    """``text`` as a TOML basic string: quotes, backslashes and every control character escaped.

    Written by hand because tomllib only reads; TOML allows no raw control character (U+0000-U+001F,
    U+007F) in a basic string, so those that have no short escape become \\uXXXX.
    """
    out = []
    for ch in text:
        if ch in _TOML_ESCAPES:
            out.append(_TOML_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def section_fields(cfg: JobConfig) -> dict[str, dict[str, dataclasses.Field[Any]]]:
    """Map section name -> key -> dataclass field."""
    return {s.name: {f.name: f for f in dataclasses.fields(getattr(cfg, s.name))} for s in dataclasses.fields(cfg)}


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, raw: Any, tp: Any, from_cli: bool) -> Any:
    """Convert a TOML value or CLI string to the field's type, or raise ConfigError."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if raw is None or (from_cli and isinstance(raw, str) and raw.lower() in ("none", "null")):
            return None
        assert len(args) == 1, f"unsupported union for {key}"
        return _coerce(key, raw, args[0], from_cli)
    if origin is Literal:
        choices = get_args(tp)
        value = raw.strip() if isinstance(raw, str) else raw
        if value not in choices:
            raise ConfigError(key, raw, f"must be {_type_name(tp)}")
        return value
    if tp is bool:
        if isinstance(raw, bool):
            return raw
        if from_cli and isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise ConfigError(key, raw, "must be true or false")
    if tp is int:
        if isinstance(raw, bool):
            raise ConfigError(key, raw, "must be an integer")
        if isinstance(raw, int):
            return raw
        if from_cli and isinstance(raw, str):
            try:
                return int(raw.replace("_", ""))
            except ValueError:
                pass
        raise ConfigError(key, raw, "must be an integer")
    if tp is float:
        if isinstance(raw, bool):
            raise ConfigError(key, raw, "must be a number")
        if isinstance(raw, (int, float)):
            value = float(raw)
        elif from_cli and isinstance(raw, str):
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(key, raw, "must be a number") from None
        else:
            raise ConfigError(key, raw, "must be a number")
        if not math.isfinite(value):
            raise ConfigError(key, raw, "must be a finite number")
        return value
    if tp is str:
        if isinstance(raw, str):
            return raw
        if from_cli:
            return str(raw)
        raise ConfigError(key, raw, "must be a string")
    raise AssertionError(f"unsupported config type {tp!r} for {key}")


def _resolved_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_ALIASES = {"checkpoint.async": "checkpoint.async_save"}


def set_value(cfg: JobConfig, dotted: str, raw: Any, from_cli: bool) -> None:
    """Set ``section.key`` on cfg from a TOML value or a CLI string, with type checks."""
    if "." not in dotted:
        raise ConfigError(dotted, raw, "options are written --section.key VALUE (e.g. --train.steps 100)")
    # `async` is a Python keyword, so the field is async_save; both spellings are accepted.
    dotted = _ALIASES.get(dotted, dotted)
    section, key = dotted.split(".", 1)
    fields = section_fields(cfg)
    if section not in fields:
        raise ConfigError(dotted, raw, f"unknown section {section!r}; sections are: {', '.join(fields)}")
    if key not in fields[section]:
        raise ConfigError(dotted, raw, f"unknown key in [{section}]; keys are: {', '.join(fields[section])}")
    obj = getattr(cfg, section)
    tp = _resolved_hints(type(obj))[key]
    setattr(obj, key, _coerce(dotted, raw, tp, from_cli))


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML job file, with one-line errors for a missing or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", str(path), "file not found")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("--config", str(path), f"not valid TOML ({e})") from None


def apply_toml(cfg: JobConfig, data: dict[str, Any]) -> None:
    for section, values in data.items():
        if not isinstance(values, dict):
            raise ConfigError(section, values, "top-level entries must be [sections]")
        for key, raw in values.items():
            set_value(cfg, f"{section}.{key}", raw, from_cli=False)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Split ``--section.key VALUE`` / ``--section.key=VALUE`` arguments into pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(arg, arg, "expected an option --section.key VALUE")
        name = arg[2:]
        if "=" in name:
            name, value = name.split("=", 1)
        else:
            if i + 1 >= len(args) or (
                args[i + 1].startswith("--") and len(args[i + 1]) > 2 and not _is_number(args[i + 1])
            ):
                raise ConfigError(f"--{name}", None, "missing value (write --section.key VALUE)")
            value = args[i + 1]
            i += 1
        pairs.append((name, value))
        i += 1
    return pairs


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def build_config(config_file: str | Path | None, overrides: list[tuple[str, str]]) -> JobConfig:
    """Defaults < TOML file < command-line overrides, then validate."""
    cfg = JobConfig()
    if config_file is not None:
        apply_toml(cfg, load_toml(config_file))
    for dotted, value in overrides:
        set_value(cfg, dotted, value, from_cli=True)
    if is_plan_file(cfg.parallel.plan):
        # A planned layout: its keys over the config file's, the command line's over both.
        named = {_ALIASES.get(k, k) for k, _ in overrides}
        for dotted, value in plan_overrides(cfg.parallel.plan).items():
            if dotted not in named:
                set_value(cfg, dotted, value, from_cli=False)
        # The resolved config (the run's config.toml) states the layout itself: run again, it is manual.
        cfg.parallel.plan = "manual"
    validate(cfg)
    return cfg


def _require(ok: bool, key: str, value: object, rule: str) -> None:
    if not ok:
        raise ConfigError(key, value, rule)


def _require_utf8(cfg: JobConfig) -> None:
    """Every string is valid UTF-8: paths reach us as bytes (a name with byte 0xff decodes to a lone
    surrogate), and the run's config.toml, logs and checkpoint manifests are UTF-8 text."""
    for section, fields in section_fields(cfg).items():
        for key in fields:
            value = getattr(getattr(cfg, section), key)
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    raise ConfigError(f"{section}.{key}", value, "is not valid UTF-8; use a name that is") from None


def validate(cfg: JobConfig) -> None:
    """Range and consistency checks that need no model or data (those come in `resolve`)."""
    t, d, p, m = cfg.train, cfg.data, cfg.parallel, cfg.model
    _require_utf8(cfg)
    for key in ("steps", "batch_size", "seq_len", "grad_accum", "val_batches"):
        _require(getattr(t, key) >= 1, f"train.{key}", getattr(t, key), "must be at least 1")
    _require(t.lr > 0, "train.lr", t.lr, "must be positive")
    _require(0.0 <= t.min_lr_ratio <= 1.0, "train.min_lr_ratio", t.min_lr_ratio, "must be between 0 and 1")
    _require(t.warmup_steps >= 0, "train.warmup_steps", t.warmup_steps, "must be 0 or more")
    _require(t.weight_decay >= 0, "train.weight_decay", t.weight_decay, "must be 0 or more")
    _require(0 <= t.beta1 < 1, "train.beta1", t.beta1, "must be in [0, 1)")
    _require(0 <= t.beta2 < 1, "train.beta2", t.beta2, "must be in [0, 1)")
    _require(t.grad_clip >= 0, "train.grad_clip", t.grad_clip, "must be 0 (off) or positive")
    _require(t.val_every >= 0, "train.val_every", t.val_every, "must be 0 (end only) or positive")
    _require(t.threads >= 0, "train.threads", t.threads, "must be 0 (default) or positive")
    _require(t.device in ("auto", "cpu", "cuda"), "train.device", t.device, "must be one of 'auto', 'cpu', 'cuda'")
    _require(
        t.batch_size % t.grad_accum == 0,
        "train.grad_accum",
        t.grad_accum,
        f"must divide train.batch_size = {t.batch_size}",
    )
    _require(bool(t.run_dir.strip()), "train.run_dir", t.run_dir, "must not be empty")
    unknown = t.run_dir
    for placeholder in RUN_DIR_PLACEHOLDERS:
        unknown = unknown.replace(placeholder, "")
    _require(
        "{" not in unknown and "}" not in unknown,
        "train.run_dir",
        t.run_dir,
        f"may hold only the placeholders {' and '.join(RUN_DIR_PLACEHOLDERS)}",
    )
    _require(0.0 < d.val_fraction < 0.5, "data.val_fraction", d.val_fraction, "must be in (0, 0.5)")
    _require(d.max_bytes >= 0, "data.max_bytes", d.max_bytes, "must be 0 (no limit) or positive")
    _require(
        d.bpe_vocab_size >= 300, "data.bpe_vocab_size", d.bpe_vocab_size, "must be at least 300 (256 bytes + merges)"
    )
    if d.path:
        _require(Path(d.path).exists(), "data.path", d.path, "no such file or folder")
    _require(
        d.tokenizer in ("byte", "bpe") or (d.tokenizer.startswith("hf:") and len(d.tokenizer) > 3),
        "data.tokenizer",
        d.tokenizer,
        "must be one of byte, bpe, hf:PATH (a folder holding tokenizer.json, or the file)",
    )
    if d.tokenizer.startswith("hf:"):
        _require(Path(d.tokenizer[3:]).expanduser().exists(), "data.tokenizer", d.tokenizer, "no such folder or file")
    for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        v = getattr(m, key)
        _require(v is None or v >= 1, f"model.{key}", v, "must be at least 1")
    for key in ("norm_eps", "rope_theta"):
        v = getattr(m, key)
        _require(v is None or v > 0, f"model.{key}", v, "must be positive")
    if m.init_from:
        _require(Path(m.init_from).exists(), "model.init_from", m.init_from, "no such folder or file")
    for key in ("nproc", "tp", "cp", "pp", "microbatches", "pp_virtual_stages"):
        _require(getattr(p, key) >= 1, f"parallel.{key}", getattr(p, key), "must be at least 1")
    _require(
        p.pp > 1 or p.microbatches == 1,
        "parallel.microbatches",
        p.microbatches,
        "counts a pipeline's microbatches and parallel.pp = 1: gradient accumulation is train.grad_accum",
    )
    for key in ("dp_replicate", "dp_shard"):
        _require(
            getattr(p, key) >= 1 or getattr(p, key) == -1,
            f"parallel.{key}",
            getattr(p, key),
            "must be at least 1, or -1 to fill what the other degrees leave",
        )
    _require(p.zero_stage in (1, 2, 3), "parallel.zero_stage", p.zero_stage, "must be 1, 2 or 3")
    c = cfg.checkpoint
    _require(p.timeout_s >= 1, "parallel.timeout_s", p.timeout_s, "must be at least 1 (seconds)")
    _require(p.max_restarts >= 0, "parallel.max_restarts", p.max_restarts, "must be 0 (no restart) or positive")
    if p.max_restarts > 0:
        _require(
            c.every > 0,
            "parallel.max_restarts",
            p.max_restarts,
            "needs checkpoint.every > 0 (a restart resumes from a checkpoint)",
        )
    _require(c.every >= 0, "checkpoint.every", c.every, "must be 0 (final only) or positive")
    _require(c.keep >= 1, "checkpoint.keep", c.keep, "must be at least 1")
    _require(bool(c.resume.strip()), "checkpoint.resume", c.resume, "must be none, auto or a checkpoint directory")
    if c.resume not in ("none", "auto"):
        _require(
            Path(c.resume).is_dir(), "checkpoint.resume", c.resume, "no such checkpoint directory (or use none or auto)"
        )
    _require(cfg.metrics.log_every >= 1, "metrics.log_every", cfg.metrics.log_every, "must be at least 1")
    validate_geo(cfg.geo)
    validate_bubbles(cfg.bubbles, p.pp)
    g = cfg.geo
    if g.dc_axis == "pp":
        _require(
            p.pp % g.datacenters == 0,
            "parallel.pp",
            p.pp,
            f"must be a multiple of geo.datacenters = {g.datacenters} with geo.dc_axis = pp (each holds pp / datacenters stages)",
        )
        _require(
            g.sync == "none",
            "geo.sync",
            g.sync,
            "must be none with geo.dc_axis = pp: data parallelism stays inside each datacenter",
        )
    _require(
        g.pp_compression == "none" or (g.dc_axis == "pp" and g.datacenters > 1 and p.pp > 1),
        "geo.pp_compression",
        g.pp_compression,
        "needs a pipeline boundary between datacenters (geo.dc_axis = pp, geo.datacenters > 1, parallel.pp > 1)",
    )
    if g.pp_early_recv:
        _require(
            g.dc_axis == "pp" and g.datacenters > 1 and p.pp > 1,
            "geo.pp_early_recv",
            g.pp_early_recv,
            "needs a pipeline boundary between datacenters (geo.dc_axis = pp, geo.datacenters > 1, parallel.pp > 1)",
        )
        _require(
            g.wan_schedule == "fair",
            "geo.pp_early_recv",
            g.pp_early_recv,
            "needs geo.wan_schedule = fair: time_shared posts each receive on its turn, which is how it orders the link",
        )
        _require(
            p.pp_schedule in ("gpipe", "1f1b"),
            "geo.pp_early_recv",
            g.pp_early_recv,
            f"needs one stage per rank (parallel.pp_schedule gpipe or 1f1b, not {p.pp_schedule}): two stages on a rank"
            " can receive from one peer on one tag, where posting order no longer names the micro-batch",
        )


def synthetic_spec(spec: str) -> tuple[int, int] | None:
    """(N, LEN) of ``synthetic:N:LEN``; None for anything else (a file path)."""
    if not spec.startswith("synthetic:"):
        return None
    parts = spec.split(":")
    rule = "synthetic:N:LEN needs two whole numbers of at least 1 (N prompts of LEN tokens)"
    if len(parts) != 3 or not all(x.isdigit() and int(x) >= 1 for x in parts[1:]):
        raise ConfigError("bubbles.prefill", spec, rule)
    return int(parts[1]), int(parts[2])


def validate_bubbles(cfg: BubblesConfig, pp: int) -> None:
    """Raise ConfigError for a bubbles setting that cannot work (checked before any process starts)."""
    if not cfg.prefill:
        return
    if synthetic_spec(cfg.prefill) is None and not Path(cfg.prefill).is_file():
        raise ConfigError("bubbles.prefill", cfg.prefill, "no such file (a JSONL of requests, or synthetic:N:LEN)")
    _require(pp > 1, "bubbles.prefill", cfg.prefill, "needs parallel.pp > 1: the bubbles filled are a pipeline's waits")


def validate_geo(cfg: GeoConfig) -> None:
    """Raise ConfigError for the first setting that breaks a rule; returns None when all hold."""
    if cfg.datacenters < 1:
        raise ConfigError("geo.datacenters", cfg.datacenters, "must be at least 1")
    if cfg.block_size < 2 or cfg.block_size % 2:
        raise ConfigError("geo.block_size", cfg.block_size, "must be an even integer of at least 2")
    if cfg.bucket_mb < 1:
        raise ConfigError("geo.bucket_mb", cfg.bucket_mb, "must be at least 1")
    if cfg.inner_steps < 1:
        raise ConfigError("geo.inner_steps", cfg.inner_steps, "must be at least 1")
    if not 1 <= cfg.wan_streams <= WAN_STREAMS_MAX:
        raise ConfigError("geo.wan_streams", cfg.wan_streams, f"must be between 1 and {WAN_STREAMS_MAX}")
    if cfg.outer_lr <= 0:
        raise ConfigError("geo.outer_lr", cfg.outer_lr, "must be positive")
    if not 0 <= cfg.outer_momentum < 1:
        raise ConfigError("geo.outer_momentum", cfg.outer_momentum, "must be in [0, 1)")
    if not 0 <= cfg.mix_alpha < 1:
        raise ConfigError("geo.mix_alpha", cfg.mix_alpha, "must be in [0, 1) (1 would never take the global value)")
    if cfg.eager and cfg.sync not in ("diloco", "streaming_diloco"):
        raise ConfigError("geo.eager", cfg.eager, f"needs geo.sync diloco or streaming_diloco, not {cfg.sync}")
    if cfg.eager and cfg.fault_tolerant:
        raise ConfigError("geo.eager", cfg.eager, "does not combine with geo.fault_tolerant (its rounds are blocking)")
    if cfg.pp_compression_rank < 1:
        raise ConfigError("geo.pp_compression_rank", cfg.pp_compression_rank, "must be at least 1")
    if not 0 < cfg.feedback_decay <= 1:
        raise ConfigError("geo.feedback_decay", cfg.feedback_decay, "must be in (0, 1]")
    if cfg.outer_dtype == "topk2":
        if not 0 < cfg.outer_density <= 1:
            raise ConfigError("geo.outer_density", cfg.outer_density, "must be in (0, 1]")
        if cfg.block_size > 65536:
            raise ConfigError("geo.block_size", cfg.block_size, "must be at most 65536 with outer_dtype topk2")
    if cfg.sync == "streaming_diloco":
        if not 1 <= cfg.fragments <= cfg.inner_steps:
            raise ConfigError(
                "geo.fragments", cfg.fragments, f"must be between 1 and geo.inner_steps = {cfg.inner_steps}"
            )
        if not 0 <= cfg.overlap_steps < cfg.inner_steps:
            raise ConfigError(
                "geo.overlap_steps",
                cfg.overlap_steps,
                f"must be in [0, geo.inner_steps = {cfg.inner_steps}): a result must land before the next sync",
            )


def resolved_outer_dtype(cfg: GeoConfig, kind: str | None = None) -> OuterWire:
    """The outer-gradient wire dtype after resolving ``auto`` (fp32 as DiLoCo, int4 as Streaming DiLoCo)."""
    if cfg.outer_dtype != "auto":
        return cfg.outer_dtype
    return "int4" if (kind or cfg.sync) == "streaming_diloco" else "fp32"


def ranks_per_datacenter(cfg: GeoConfig, world_size: int) -> int:
    """Data-parallel ranks per datacenter; ConfigError when the ranks do not split evenly."""
    if world_size % cfg.datacenters:
        raise ConfigError(
            "geo.datacenters",
            cfg.datacenters,
            f"must divide the {world_size} data-parallel ranks into equal datacenters",
        )
    return world_size // cfg.datacenters
