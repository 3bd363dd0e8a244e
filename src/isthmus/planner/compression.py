"""What the WAN's lossy encodings cost and what they trade: compressed pipeline boundaries and the
outer gradients of DiLoCo's two kinds.

- A pipeline boundary between datacenters (``geo.pp_compression``) carries each message in
  ``isthmus.layout.wire``'s wire bytes (those of ``isthmus.parallel.boundary_codec``), and both ends pay its encode/decode arithmetic
  (``encode_flops``, one message's encode and decode together) at the device's GEMM rate: half on
  the sender, half on the receiver, for every microbatch's activation and its gradient. Boundaries
  inside a datacenter stay exact.
- DiLoCo's outer gradients (``geo.outer_dtype``) cross the WAN in fp32 as an all-reduce, or, in any
  lossy dtype, as an all-gather of each datacenter's payload (what ``isthmus.geo.diloco`` runs);
  topk2's bytes are ``isthmus.layout.wire.topk2_payload_nbytes`` (those of ``isthmus.geo.sparse``).
- What each lossy method costs in quality is measured, not assumed: ``compression.toml`` beside
  this module holds the loss at equal tokens relative to exact and the command that measured it.
  The planner chooses a lossy method only when its measured penalty is within the file's
  tolerance; an unmeasured one, or one over the tolerance, is shown as a what-if.

The byte and arithmetic counts come from ``isthmus.layout.wire``, the torch-free formulas the
runtime's codecs use too, so planning stays torch-free.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from isthmus.layout import wire
from isthmus.layout.spec import LayoutSpec
from isthmus.planner.compute import act_bytes
from isthmus.planner.topology import DeviceKind
from isthmus.planner.workload import Runtime, Workload

QUALITY_FILE = Path(__file__).with_name("compression.toml")
OUTER_BLOCK_SIZE = 256
"""``geo.block_size``'s default: the chunk every quantised or sparse outer payload is priced at."""
INT_SCALE_BYTES = 4 / OUTER_BLOCK_SIZE
"""int8 / int4 outer gradients: one fp32 scale per block (``isthmus.geo.compress``)."""


# --- pipeline boundaries ------------------------------------------------------------------------


def compressed(layout: LayoutSpec) -> bool:
    """Whether the layout's boundaries between datacenters carry compressed messages."""
    return layout.pp_compression != "none" and layout.dc_axis == "pp" and layout.pp > 1


def message_tokens(work: Workload, layout: LayoutSpec, runtime: Runtime) -> int:
    """Tokens (rows of ``dim``) of the activation one device sends across a boundary per microbatch."""
    split = layout.tp if runtime.scatter_gather or layout.sequence_parallel else 1
    return max(1, round(layout.micro_batch * work.seq_len / layout.cp / split))


def boundary_message(work: Workload, layout: LayoutSpec, runtime: Runtime, wan: bool) -> float:
    """Bytes one device sends across a pipeline boundary per microbatch, an activation or its
    gradient: compressed on a boundary between datacenters (``wan``) when the layout says so."""
    act = layout.micro_batch * work.seq_len / layout.cp * work.args.dim * act_bytes(work.dtype)
    exact = act / (layout.tp if runtime.scatter_gather or layout.sequence_parallel else 1)
    if not (wan and compressed(layout)):
        return exact
    tokens = message_tokens(work, layout, runtime)
    elem = max(1, round(act_bytes(work.dtype)))
    return float(wire.wire_bytes(layout.pp_compression, tokens, work.args.dim, elem, layout.pp_compression_rank))


def codec_seconds(kind: DeviceKind, work: Workload, layout: LayoutSpec, runtime: Runtime) -> float:
    """Seconds one end of a compressed boundary spends on one message (its half of encode + decode),
    at the device's GEMM rate; 0 without compression."""
    if not compressed(layout):
        return 0.0
    flops = wire.encode_flops(
        layout.pp_compression, message_tokens(work, layout, runtime), work.args.dim, layout.pp_compression_rank
    )
    return flops / 2 / (kind.peak(work.dtype) * kind.gemm_max_fraction)


# --- DiLoCo's outer gradients ---------------------------------------------------------------------


def outer_wire(layout: LayoutSpec) -> str:
    """The dtype DiLoCo's outer gradients cross the WAN in (``geo.outer_dtype``, auto resolved)."""
    if layout.outer_dtype != "auto":
        return layout.outer_dtype
    return "int4" if layout.sync == "streaming_diloco" else "fp32"


def outer_bytes_per_param(layout: LayoutSpec) -> float:
    """Bytes per parameter of one datacenter's outer-gradient payload."""
    dtype = outer_wire(layout)
    if dtype == "topk2":
        k = wire.topk2_chunk_k(OUTER_BLOCK_SIZE, layout.outer_density)
        numel = 4 * OUTER_BLOCK_SIZE  # whole chunks and whole bytes of codes: the per-element rate exactly
        return wire.topk2_payload_nbytes(numel, OUTER_BLOCK_SIZE, k) / numel
    return {"fp32": 4, "bf16": 2, "int8": 1 + INT_SCALE_BYTES, "int4": 0.5 + INT_SCALE_BYTES}[dtype]


def outer_equivalent(nbytes: float, dcs: int, layout: LayoutSpec, runtime: Runtime) -> float:
    """The all-reduce size whose WAN phase moves what the outer sync of ``nbytes`` worth of gradients
    moves: fp32 is all-reduced as it is; a lossy payload P is all-gathered, (k - 1) P leaving each of
    k datacenters, as in the WAN phase of an all-reduce of k P / 2."""
    payload = nbytes / runtime.grad_bytes * outer_bytes_per_param(layout)
    return payload if outer_wire(layout) == "fp32" else payload * dcs / 2


# --- what they trade ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quality:
    """One lossy method's measured cost in loss (``compression.toml``)."""

    setting: str
    """The config key it is a value of: pp_compression or outer_dtype."""
    method: str
    loss_penalty: float | None
    """Loss at equal tokens over exact's, minus 1 (0.003: +0.3%); None: not measured."""
    reference: str
    """What it is measured against (exact boundaries, flat all-reduce)."""
    command: str
    """The command that measured it (the benchmark, when unmeasured)."""


@dataclass(frozen=True)
class QualityTable:
    tolerance: float
    """The largest measured loss penalty the planner accepts of a method it chooses on its own."""
    entries: dict[tuple[str, str], Quality]

    def of(self, setting: str, method: str) -> Quality | None:
        return self.entries.get((setting, method))


def quality_table() -> QualityTable:
    """The measured quality figures of :data:`QUALITY_FILE`; an entry without ``loss_penalty`` is unmeasured."""
    return _load_quality(QUALITY_FILE)


@lru_cache(maxsize=4)
def _load_quality(path: Path) -> QualityTable:
    data = tomllib.loads(path.read_text())
    entries = {}
    for setting in ("pp_compression", "outer_dtype"):
        for method, row in data.get(setting, {}).items():
            entries[(setting, method)] = Quality(
                setting, method, row.get("loss_penalty"), row.get("reference", "exact"), row.get("command", "")
            )
    return QualityTable(float(data["tolerance"]), entries)


def lossy_choices(layout: LayoutSpec) -> list[tuple[str, str]]:
    """(setting, method) of each lossy encoding the layout uses on the WAN."""
    out: list[tuple[str, str]] = []
    if compressed(layout):
        out.append(("pp_compression", layout.pp_compression))
    if layout.dc_axis == "dp" and layout.sync in ("diloco", "streaming_diloco") and layout.outer_dtype == "topk2":
        out.append(("outer_dtype", "topk2"))
    return out


def not_chosen(layout: LayoutSpec, table: QualityTable | None = None) -> str | None:
    """Why the planner would not choose the layout's lossy encodings on its own (unmeasured, or a
    measured loss over the tolerance), in a few words; None when it may."""
    table = table or quality_table()
    for setting, method in lossy_choices(layout):
        q = table.of(setting, method)
        name = f"{setting} {method}"
        if q is None or q.loss_penalty is None:
            return f"{name}: loss unmeasured"
        if q.loss_penalty > table.tolerance:
            return f"{name}: loss {100 * q.loss_penalty:+.1f}%, over the {100 * table.tolerance:g}% tolerance"
    return None


def loss_words(setting: str, method: str, table: QualityTable | None = None) -> str:
    """``loss +0.3% vs exact at equal tokens (benchmarks/x.py)``, or ``loss unmeasured (benchmarks/x.py)``."""
    q = (table or quality_table()).of(setting, method)
    script = next((w for w in q.command.split() if w.endswith(".py")), q.command) if q else ""
    where = f" ({script})" if script else ""
    if q is None or q.loss_penalty is None:
        return f"loss unmeasured{where}"
    return f"loss {100 * q.loss_penalty:+.1f}% vs {q.reference} at equal tokens{where}"
