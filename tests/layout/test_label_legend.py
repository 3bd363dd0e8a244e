"""Every token a layout label can print has a legend entry (`isthmus plan --legend`, docs/planning.md),
and the legend names no token a label never prints: both come from `isthmus.layout.spec`."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from isthmus.layout.choices import (
    ACTIVATION_CHECKPOINTS,
    CP_IMPLS,
    OUTER_DTYPES,
    PP_COMPRESSIONS,
    PP_SCHEDULES,
    SYNC_KINDS,
    WAN_SCHEDULES,
)
from isthmus.layout.spec import LABEL_LEGEND, LayoutSpec, label_parts, legend_for

DOCS = Path(__file__).resolve().parents[2] / "docs" / "planning.md"


def _layouts() -> list[LayoutSpec]:
    """A layout for every word of every choice a label shows, and each mechanism on and off."""
    out = [LayoutSpec()]
    for sched, ac, wan in itertools.product(PP_SCHEDULES, ACTIVATION_CHECKPOINTS, WAN_SCHEDULES):
        vs = 2 if sched in ("interleaved_1f1b", "zero_bubble") else 1
        out.append(
            LayoutSpec(
                tp=4,
                sequence_parallel=True,
                pp=4,
                pp_schedule=sched,
                pp_virtual_stages=vs,
                microbatches=8,
                activation_checkpoint=ac,
                datacenters=2,
                dc_axis="pp",
                wan_schedule=wan,
            )
        )
    for cp_impl, sync in itertools.product(CP_IMPLS, SYNC_KINDS):
        out.append(
            LayoutSpec(
                cp=2,
                cp_impl=cp_impl,
                ep=2,
                dp_replicate=2,
                dp_shard=4,
                zero_stage=3,
                datacenters=2,
                dc_axis="dp",
                sync=sync,
            )
        )
    pipe = LayoutSpec(pp=2, microbatches=4, datacenters=2, dc_axis="pp")
    out += [pipe.with_(pp_compression=method) for method in PP_COMPRESSIONS]
    diloco = LayoutSpec(dp_replicate=2, datacenters=2, dc_axis="dp", sync="diloco")
    out += [diloco.with_(outer_dtype=dtype) for dtype in OUTER_DTYPES]
    out.append(LayoutSpec(dp_shard=8, zero_stage=2, grad_accum=4, micro_batch=2))
    return out


def test_every_token_a_label_prints_has_a_legend_entry_and_none_is_unused() -> None:
    legend = {part.token for part in LABEL_LEGEND}
    printed = {t for lay in _layouts() for t in label_parts(lay.label())}
    assert printed - legend == set(), f"tokens without a legend entry: {sorted(printed - legend)}"
    assert legend - printed == set(), f"legend entries no label prints: {sorted(legend - printed)}"


def test_label_parts_split_a_label_into_its_tokens() -> None:
    label = "tp4 sp cp2u pp4/dc i1f1b v8 ts dp512(r64 s8) z3/dc sdiloco H100 F4 t1 mb2x1 ac-full"
    assert label_parts(label) == [
        *("tpN", "sp", "cpNu", "ppN", "/dc", "i1f1b", "vN", "ts", "dpN", "(rN sN)", "zN", "/dc"),
        *("sdiloco", "HN", "FN", "tN", "mbNxN", "ac-full"),
    ]
    assert [p.token for p in legend_for(["tp1 dp8 z2 mb1x1"])] == ["tpN", "dpN", "zN", "mbNxN"]


def test_the_docs_table_has_every_legend_entry() -> None:
    docs = DOCS.read_text()
    rows = set(re.findall(r"^\| `([^`]+)` \|", docs, flags=re.M))
    assert {part.token for part in LABEL_LEGEND} <= rows
