"""Published measurements the cost model is checked against, and the layouts they used.

Narayanan et al. 2021 (Megatron-LM, SC'21), Table 1: GPT models from 1.7B to 1T parameters on
Selene (A100 80GB), sequence length 2048, vocabulary 51,200, full activation recomputation,
per-GPU TFLOP/s counted by the paper's Eq. 3 (recomputation included). The paper used the
interleaved schedule with the scatter/gather optimisation; Megatron's interleaved schedule needs
pp > 2 and microbatches divisible by pp, so the pp = 2 row runs 1F1B. Microbatch size is 1.

Other published runs (Korthikanti et al. 2022, MT-NLG, BLOOM) are rows of ``published_runs.csv``,
each with its source, what it reported, and the ``isthmus simulate`` command that reproduces it.
"""

from __future__ import annotations

import csv
import shlex
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from isthmus.layout.choices import PpSchedule
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flavors import gpt3
from isthmus.planner.cost import Estimate, estimate
from isthmus.planner.topology import Topology, load_topology
from isthmus.planner.workload import RUNTIMES, Workload

SEQ_LEN = 2048


@dataclass(frozen=True)
class MegatronRow:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int
    tflops_per_gpu: float


MEGATRON_2021_TABLE1: tuple[MegatronRow, ...] = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

MICRO_BATCH = 1
VIRTUAL_STAGES = 2
"""Model chunks per rank of the interleaved schedule (the smallest that divides layers / pp)."""


def megatron_layout(row: MegatronRow) -> LayoutSpec:
    """The paper's layout for a row: its tp and pp, the rest data-parallel, b = 1."""
    dp = row.gpus // (row.tp * row.pp)
    m = row.global_batch // (dp * MICRO_BATCH)
    schedule: PpSchedule
    if row.pp <= 2:
        schedule, v = "1f1b", 1
    else:
        per_rank = row.layers // row.pp
        v = next(k for k in range(VIRTUAL_STAGES, per_rank + 1) if per_rank % k == 0)
        schedule = "interleaved_1f1b"
    return LayoutSpec(
        tp=row.tp,
        pp=row.pp,
        pp_schedule=schedule,
        pp_virtual_stages=v,
        dp_replicate=dp,
        micro_batch=MICRO_BATCH,
        microbatches=m if row.pp > 1 else 1,
        grad_accum=1 if row.pp > 1 else m,
        activation_checkpoint="full",
    )


def megatron_row_estimate(row: MegatronRow, topo: Topology | None = None) -> Estimate:
    topo = (topo or load_topology("selene-a100")).subset(row.gpus)
    work = Workload(gpt3(row.heads, row.hidden, row.layers), row.global_batch, SEQ_LEN, "fp16")
    return estimate(work, topo, megatron_layout(row), RUNTIMES["megatron-2021"])


@dataclass(frozen=True)
class PublishedRun:
    """One row of ``published_runs.csv``: a published run, what it reported, and the
    ``isthmus simulate`` arguments that reproduce it."""

    source: str
    table: str
    year: int
    hardware: str
    software: str
    runtime: str
    row: str
    metric: str
    """'step_time_s', 'tflops_per_device', 'tokens_per_s_per_device' or 'mfu' (a fraction)."""
    published: float
    assumed: str
    args: str

    def argv(self) -> list[str]:
        """The ``isthmus`` command line of this row (with ``--json``)."""
        return ["simulate", *shlex.split(self.args), "--runtime", self.runtime, "--json"]

    def option(self, flag: str) -> str:
        """The value of one flag of ``args`` (``--micro-batch``, ``--parallel.pp``)."""
        words = shlex.split(self.args)
        return words[words.index(flag) + 1]


def published_runs() -> tuple[PublishedRun, ...]:
    """Every row of ``published_runs.csv`` (beside this module), in file order."""
    text = Path(__file__).with_name("published_runs.csv").read_text()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    rows = []
    for raw in csv.DictReader(lines):
        rows.append(
            PublishedRun(
                **{k: raw[k] for k in ("source", "table", "hardware", "software", "runtime", "row", "metric")},
                year=int(raw["year"]),
                published=float(raw["published"]),
                assumed=raw["assumed"],
                args=raw["args"],
            )
        )
    return tuple(rows)


def implied_micro_batch(runs: Sequence[tuple[float, float]], pp: int) -> float:
    """The micro-batch under which published step times of one model and pipeline at several data-parallel
    sizes fit one 1F1B schedule, for a source that gives the times but not its micro-batch (MT-NLG).

    ``runs``: (samples per pipeline per step, seconds per step). Under 1F1B a step takes (m + pp - 1) t
    for m = samples / b microbatches of t seconds each, i.e. samples * t / b + (pp - 1) t: a line in the
    samples whose intercept over its slope is (pp - 1) b. The least-squares line through the runs gives b.
    """
    if len(runs) < 2 or pp < 2:
        raise ValueError("implied_micro_batch needs two or more runs of a pipeline (pp >= 2)")
    slope, intercept = statistics.linear_regression([s for s, _ in runs], [t for _, t in runs])
    return intercept / slope / (pp - 1)


def source_micro_batch(rows: Sequence[PublishedRun]) -> float | None:
    """The micro-batch a source's step times imply (:func:`implied_micro_batch`) where its rows are one
    model, batch and pipeline at several data-parallel sizes; None for any other set of rows."""
    if len(rows) < 2 or any(r.metric != "step_time_s" for r in rows):
        return None
    shapes = {(r.option("--model.flavor"), r.option("--parallel.pp"), r.option("--train.batch_size")) for r in rows}
    if len(shapes) != 1:
        return None
    pp = int(rows[0].option("--parallel.pp"))
    if pp < 2 or any("dp_replicate" not in r.args for r in rows):
        return None
    runs = [(int(r.option("--train.batch_size")) / int(r.option("--parallel.dp_replicate")), r.published) for r in rows]
    return implied_micro_batch(runs, pp)
