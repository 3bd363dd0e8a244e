"""Turn a search result into what a person reads: a ranked table and why the winner wins."""

from __future__ import annotations

from isthmus.layout.choices import DILOCO_SYNCS, PP_COMPRESSIONS
from isthmus.layout.spec import LayoutSpec
from isthmus.models.flops import count_params
from isthmus.planner.comm import Span
from isthmus.planner.compression import QUALITY_FILE, loss_words, not_chosen, outer_wire, quality_table
from isthmus.planner.cost import Estimate, estimate
from isthmus.planner.placement import place, runnable
from isthmus.planner.search import SearchResult
from isthmus.planner.topology import Topology

COLUMNS = ("#", "layout", "step s", "tokens/s", "TFLOP/s/dev", "MFU", "mem GB", "bubble", "WAN GB/step", "bottleneck")


def table_rows(ranked: list[Estimate], mark: str = "") -> list[list[str]]:
    """One row per layout, numbered from 1 (``mark`` before each number: ``w`` for the what-ifs)."""
    rows = []
    for i, est in enumerate(ranked, 1):
        rows.append(
            [
                f"{mark}{i}",
                est.layout.label(),
                f"{est.step_time_s:.3g}",
                f"{est.tokens_per_s:,.0f}",
                f"{est.tflops_per_device:.1f}",
                f"{100 * est.mfu:.1f}%",
                f"{est.mem_per_device_gb:.1f}",
                f"{100 * est.bubble_fraction:.1f}%",
                f"{est.wan_bytes_per_step / 1e9:.3g}",
                est.bottleneck,
            ]
        )
    return rows


WHAT_IFS = "planner-only what-ifs: faster than #1, but the runtime cannot run them as placed"
"""The line over the what-ifs' rows (:attr:`SearchResult.what_ifs`)."""


def format_table(result: SearchResult, top: int, topo: Topology | None = None) -> str:
    """A plain-text table, columns aligned (numbers right, words left): the layouts the runtime runs,
    then, under their own line, the what-ifs that beat them (``w1``, ``w2``, ... each with why it
    does not run when ``topo`` is given)."""
    runs, ifs = table_rows(result.ranked[:top]), table_rows(result.what_ifs[:top], "w")
    rows = [list(COLUMNS), *runs, *ifs]
    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
    left = {1, 9}

    def line(r: list[str]) -> str:
        return "  ".join(r[c].ljust(widths[c]) if c in left else r[c].rjust(widths[c]) for c in range(len(COLUMNS)))

    lines = [line(list(COLUMNS)).rstrip(), "  ".join("-" * w for w in widths)]
    if result.ranked and runnable_of(result, topo) is not None:
        lines[0:0] = ["no layout runs as placed: every row is a planner-only what-if"]
    lines += [line(r).rstrip() for r in runs]
    if ifs:
        lines.append("")
        lines.append(WHAT_IFS + ":")
        for r, est in zip(ifs, result.what_ifs):
            why = runnable(topo, est.layout) if topo is not None else None
            lines.append(line(r).rstrip() + (f"  ({why})" if why else ""))
    return "\n".join(lines)


def runnable_of(result: SearchResult, topo: Topology | None) -> str | None:
    """Why the chosen layout (``result.best``) does not run as placed, or None (or no ``topo``)."""
    return None if topo is None else runnable(topo, result.best.layout)


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):.0f}%"


def _share(est: Estimate, key: str) -> str:
    return f"{100 * est.breakdown.get(key, 0.0) / est.step_time_s:.0f}%"


def explain(result: SearchResult, topo: Topology) -> str:
    """One paragraph: what the winner is, what each of its choices buys, and what it beat."""
    best = result.best
    work = best.work
    lay = best.layout
    pl = place(topo, lay)
    site = pl.sites[0]
    dc = site.dc
    n = count_params(work.args)
    params = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
    out = [
        f"{params} parameters at {work.batch_size} x {work.seq_len} tokens per step on {topo.name} "
        f"({lay.world:,} x {dc.kind.name}) runs best as {lay.label()}: {best.tokens_per_s:,.0f} tokens/s, "
        f"MFU {100 * best.mfu:.1f}%, {best.mem_per_device_gb:.1f} of {dc.kind.memory_bytes / 1e9:.0f} GB per device."
    ]
    if lay.tp > 1:
        out.append(
            f"Tensor parallelism of {lay.tp} stays inside a node of {dc.devices_per_node} devices, so its four "
            f"collectives per block run at {dc.intra_node.bandwidth / 1e9:.0f} GB/s ({_share(best, 'tp comm')} of the step)."
        )
    if lay.pp > 1:
        out.append(
            f"{lay.pp} pipeline stages under {lay.pp_schedule} with {lay.microbatches} microbatches idle "
            f"{100 * best.bubble_fraction:.0f}% of the step."
        )
    if work.args.is_moe:
        out.append(expert_sentence(result, site.ep))
    state = "no recomputation" if lay.activation_checkpoint == "none" else f"{lay.activation_checkpoint} recomputation"
    shard = f"ZeRO-{lay.zero_stage} over {lay.shard_degree} ranks" if lay.shard_degree > 1 else "no sharding"
    out.append(f"It fits with {state} and {shard}.")
    out.extend(_wan_sentences(result, topo))
    out.extend(placement_sentences(result, topo))
    second = _runner_up(result)
    if second is not None:
        out.append(
            f"It beats the best layout that differs in more than the data-parallel split "
            f"({second.layout.label()}) by {_pct(best.effective_tokens_per_s, second.effective_tokens_per_s)}."
        )
    decided = feature_sentence(result, topo)
    if decided:
        out.append(decided)
    top_cost = best.bottleneck
    if top_cost != "compute":
        out.append(f"What limits it now is {top_cost} ({_share(best, top_cost)} of the step).")
    else:
        out.append("It is compute-bound: every other cost is under 5% of the step.")
    return " ".join(out)


FEATURE_OFF: tuple[tuple[str, object, str], ...] = (
    ("tp_overlap", "none", "tensor-parallel collectives pipelined under their GEMMs"),
    ("dp_overlap", False, "gradient reduction overlapped with backward"),
    ("param_overlap", False, "parameter gathers overlapped with forward"),
    ("fused_pointwise", False, "fused norms and activations"),
    ("fused_cross_entropy", False, "a fused cross-entropy"),
)
"""Each runtime feature the explanation weighs, the value that turns it off, and its name in words."""
FEATURE_MATTERS = 0.02
"""A feature is named as deciding the plan when turning it off slows the chosen layout by this share."""


def feature_sentence(result: SearchResult, topo: Topology) -> str:
    """Which of the assumed software features the chosen layout's speed rests on: each one turned off
    alone, the same layout estimated again; those that cost at least :data:`FEATURE_MATTERS` are named
    with what they are worth (``--runtime.<feature>`` sets them)."""
    best, runtime = result.best, result.runtime
    worth = []
    for feature, off, words in FEATURE_OFF:
        if getattr(runtime, feature) == off or (feature == "param_overlap" and runtime.gathers_overlap == off):
            continue
        slower = estimate(best.work, topo, best.layout, runtime.with_features(**{feature: off})).step_time_s
        if slower > best.step_time_s * (1 + FEATURE_MATTERS):
            worth.append(f"{words} ({feature}: {100 * (slower / best.step_time_s - 1):.0f}% of the step)")
    if best.work.dtype == "fp8":
        worth.append(f"FP8 GEMMs scaled {runtime.fp8_recipe}")
    if not worth:
        return ""
    return f"It assumes the software does {'; '.join(worth)}."


def expert_sentence(result: SearchResult, span: Span | None) -> str:
    """Why the winner's expert parallelism: where its all-to-alls run, what each rank holds, and the
    best layout with another ep."""
    best = result.best
    lay, a = best.layout, best.work.args
    if lay.ep > 1 and span is not None:
        where = (
            f"inside one node ({span.intra.bandwidth / 1e9:.0f} GB/s)"
            if span.nodes == 1
            else f"across {span.nodes} nodes ({span.fabric.bandwidth / 1e9:.0f} GB/s per device)"
        )
        s = (
            f"Expert parallelism of {lay.ep} gives each rank {a.n_experts // lay.ep} of the {a.n_experts} experts "
            f"of every MoE layer (1/{lay.ep} of their weights and optimizer state); its token dispatch and combine "
            f"all-to-alls run {where} and take {_share(best, 'ep comm')} of the step, at "
            f"{result.runtime.expert_imbalance:g}x the mean load on the busiest expert."
        )
    else:
        s = (
            f"Every rank keeps all {a.n_experts} experts (ep 1): no all-to-all, and the experts' weights and "
            "optimizer state are held like the dense part's."
        )
    rivals = [e for k, e in result.alternatives.items() if k.startswith("ep=") and e.layout.ep != lay.ep]
    rival = max(rivals, key=lambda e: e.effective_tokens_per_s, default=None)
    if rival is not None:
        s += (
            f" The best with ep {rival.layout.ep} ({rival.layout.label()}) reaches {rival.tokens_per_s:,.0f} "
            f"tokens/s, {_pct(best.effective_tokens_per_s, rival.effective_tokens_per_s)} behind."
        )
    return s + " Experts stay inside a datacenter: ep folds over dp_shard x cp, never over replicas across the WAN."


def _core(est: Estimate) -> tuple[object, ...]:
    lay = est.layout
    return (
        lay.tp,
        lay.cp,
        lay.pp,
        lay.pp_schedule,
        lay.pp_virtual_stages,
        lay.micro_batch,
        lay.activation_checkpoint,
        lay.dc_axis,
        lay.sync,
    )


def _runner_up(result: SearchResult) -> Estimate | None:
    """The best layout whose parallel degrees, schedule or placement differ from the winner's."""
    core, tps = _core(result.best), result.best.effective_tokens_per_s
    pool = list(result.ranked[1:]) + sorted(result.alternatives.values(), key=lambda e: -e.effective_tokens_per_s)
    # A faster what-if is no runner-up: placement_sentences names it.
    return next((e for e in pool if _core(e) != core and e.effective_tokens_per_s <= tps), None)


def _wan_sentences(result: SearchResult, topo: Topology) -> list[str]:
    if len(topo.datacenters) < 2:
        return []
    best, alt = result.best, result.alternatives
    lay = best.layout
    speeds = sorted({l.bandwidth / 1e9 for l in topo.wan.values()})
    links = (
        f"{speeds[0]:.3g} GB/s links" if len(speeds) == 1 else f"links of {', '.join(f'{b:.3g}' for b in speeds)} GB/s"
    )
    others = {
        k: v
        for k, v in alt.items()
        if k.startswith(("dc_axis=", "sync=")) and (v.layout.dc_axis, v.layout.sync) != (lay.dc_axis, lay.sync)
    }
    rival = max(others.values(), key=lambda e: e.effective_tokens_per_s, default=None)
    if lay.dc_axis == "pp":
        s = (
            f"Only pipeline activations cross the WAN ({links}): {best.wan_bytes_per_step / 1e9:.3g} GB per step, "
            "with per-layer traffic (tp, cp, sp, ZeRO gathers) kept inside each datacenter."
        )
    elif lay.dc_axis == "dp":
        how = {
            "flat": "one flat ring",
            "hierarchical": "hierarchical all-reduce of gradient shards",
            "compressed": "compressed gradient shards",
            "diloco": f"DiLoCo outer steps every {lay.inner_steps} steps",
            "streaming_diloco": f"Streaming DiLoCo ({lay.fragments} fragments in turn over {lay.inner_steps} steps, "
            f"each transfer overlapping {lay.overlap_steps} step(s), {outer_wire(lay)})",
        }[lay.sync]
        s = (
            f"Data-parallel replicas span the datacenters and synchronise over the WAN ({links}) by {how}: "
            f"{best.wan_bytes_per_step / 1e9:.3g} GB per step; per-layer traffic stays inside each datacenter."
        )
        if lay.sync in ("compressed", *DILOCO_SYNCS):
            s += f" Its ranking assumes {100 * (1 - best.effective_tokens_per_s / best.tokens_per_s):.0f}% more tokens for the same loss."
    else:
        s = (
            f"It uses one datacenter: of the layouts the runtime runs as placed, none across datacenters "
            f"({links}) is faster."
            if result.what_ifs
            else f"It uses one datacenter: the WAN ({links}) would cost more than the other datacenters add."
        )
    # A faster rival is a what-if, which placement_sentences names.
    if rival is not None and rival.effective_tokens_per_s <= best.effective_tokens_per_s:
        r = rival.layout
        what = (
            "pipeline stages across datacenters"
            if r.dc_axis == "pp"
            else f"data parallelism across datacenters ({r.sync})"
            if r.dc_axis == "dp"
            else "one datacenter"
        )
        s += (
            f" The best with {what} ({r.label()}) reaches {rival.tokens_per_s:,.0f} tokens/s, "
            f"{_pct(best.effective_tokens_per_s, rival.effective_tokens_per_s)} behind."
        )
    return [s]


def placement_sentences(result: SearchResult, topo: Topology) -> list[str]:
    """Which datacenters the winner uses and what the others would cost, how its stages are spread,
    what time-shared WAN slots buy, and whether the runtime can run it as placed."""
    n = len(topo.datacenters)
    if n < 2:
        return []
    best = result.best
    lay = best.layout
    pl = place(topo, lay)
    names = [topo.datacenters[i].name for i in pl.dcs]
    left = [d.name for i, d in enumerate(topo.datacenters) if i not in pl.dcs]
    out = [f"It uses {_names(names)} ({len(names)} of {n} datacenters)."]
    if left:
        # The best layout over more datacenters: what adding the ones left out would do to a step.
        wider = [
            e
            for k in range(lay.datacenters + 1, n + 1)
            if (e := result.alternatives.get(f"datacenters={k}")) is not None
        ]
        if wider:
            more = max(wider, key=lambda e: e.effective_tokens_per_s)
            added = [topo.datacenters[i].name for i in place(topo, more.layout).dcs if i not in pl.dcs]
            out.append(
                f"It leaves out {_names(left)}: with {_names(added)} the best layout ({more.layout.label()}) "
                f"takes {more.step_time_s:.3g} s per step, against {best.step_time_s:.3g} s without"
                + (" (a planner-only what-if)." if runnable(topo, more.layout) else ".")
            )
        else:
            out.append(f"It leaves out {_names(left)}: no layout that uses them fits or is valid.")
    if lay.dc_axis == "pp":
        counts = pl.stages_per_dc
        spread = ", ".join(f"{c} in {name}" for c, name in zip(counts, names))
        out.append(
            f"Its {lay.pp} pipeline stages are spread {spread} (by compute, every device used where the sizes "
            f"allow), each stage with its {lay.dp} data-parallel replica(s) in one datacenter, so only stage "
            "boundaries cross the WAN."
        )
        other = "fair" if lay.wan_schedule == "time_shared" else "time_shared"
        alt = estimate(best.work, topo, lay.with_(wan_schedule=other), result.runtime, pl)
        ts, fair = (best, alt) if other == "fair" else (alt, best)
        k = max((share for _, share, wan in pl.boundary_links if wan), default=1)
        out.append(
            f"With {k} transfers per WAN link at a boundary, time-shared slots take {ts.step_time_s:.3g} s per step "
            f"and fair sharing {fair.step_time_s:.3g} s (geo.wan_schedule = {lay.wan_schedule})."
        )
    why = runnable(topo, lay)
    if why is not None:
        pool = list(result.ranked) + sorted(result.alternatives.values(), key=lambda e: -e.effective_tokens_per_s)
        real = next((e for e in pool if runnable(topo, e.layout) is None), None)
        s = f"This is a planner-only what-if: the runtime cannot run it as placed (it {why})."
        if real is not None:
            s += (
                f" The best layout the runtime runs as planned is {real.layout.label()}: "
                f"{real.tokens_per_s:,.0f} tokens/s, {real.step_time_s:.3g} s per step."
            )
        out.append(s)
    elif result.what_ifs:
        lead = result.what_ifs[0]
        out.append(
            f"A planner-only what-if would be faster: {lead.layout.label()} reaches {lead.tokens_per_s:,.0f} tokens/s "
            f"({_pct(lead.effective_tokens_per_s, best.effective_tokens_per_s)} more), but the runtime cannot run it as "
            f"placed (it {runnable(topo, lead.layout)})."
        )
    return out


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def result_json(result: SearchResult, topo: Topology, top: int) -> dict[str, object]:
    return {
        "topology": topo.name,
        "devices": topo.n_devices,
        # Nodes per datacenter as planned (after --nodes and --gpus), by the flag's own name.
        "nodes": {dc.name: dc.nodes for dc in topo.datacenters},
        "model_params": count_params(result.best.work.args),
        "considered": result.considered,
        "pruned_memory": result.pruned_memory,
        # The chosen layout first; each row's what_if is null when the runtime runs it as placed, else
        # why not (the what-ifs follow the layouts that run).
        "layouts": [
            {**est.as_json(), "what_if": runnable(topo, est.layout)}
            for est in result.ranked[:top] + result.what_ifs[:top]
        ],
        "explanation": explain(result, topo),
        "trades": trades(result, topo),
    }


def trades(result: SearchResult, topo: Topology) -> list[str]:
    """What each lossy WAN encoding trades at this topology's WAN figures, one line each: WAN bytes
    and step time against exact, and the loss measured at equal tokens. For the best pipeline across
    datacenters, every boundary compression; for the best DiLoCo layout, its outer dtype against
    topk2 (or auto, where it is topk2)."""
    runtime, lines = result.runtime, []
    best = result.best
    pp = best if best.layout.dc_axis == "pp" else result.alternatives.get("dc_axis=pp")
    if pp is not None and pp.layout.pp > 1:
        exact = estimate(pp.work, topo, pp.layout.with_(pp_compression="none"), runtime)
        for method in PP_COMPRESSIONS[1:]:
            est = estimate(pp.work, topo, pp.layout.with_(pp_compression=method), runtime)
            name = f"{method} (rank {est.layout.pp_compression_rank})" if method == "lowrank" else method
            lines.append(
                f"{name} boundaries: {_fewer(exact, est)}, step {est.step_time_s:.3g} s vs "
                f"{exact.step_time_s:.3g} s exact; {loss_words('pp_compression', method)}{_status(est.layout)}"
            )
    syncs = [e for k, e in result.alternatives.items() if k in (f"sync={s}" for s in DILOCO_SYNCS)]
    dp = best if best.layout.sync in DILOCO_SYNCS else max(syncs, key=lambda e: e.effective_tokens_per_s, default=None)
    if dp is not None and dp.layout.dc_axis == "dp":
        other = "topk2" if dp.layout.outer_dtype != "topk2" else "auto"
        base = dp if other == "topk2" else estimate(dp.work, topo, dp.layout.with_(outer_dtype=other), runtime)
        sparse = estimate(dp.work, topo, base.layout.with_(outer_dtype="topk2"), runtime)
        lines.append(
            f"topk2 outer gradients ({dp.layout.sync}): {_fewer(base, sparse)} than {outer_wire(base.layout)}, "
            f"step {sparse.step_time_s:.3g} s vs {base.step_time_s:.3g} s; "
            f"{loss_words('outer_dtype', 'topk2')}{_status(sparse.layout)}"
        )
    if not lines:
        return []
    tol = quality_table().tolerance
    head = f"WAN trades (loss from {QUALITY_FILE.name}; chosen only within {100 * tol:g}% of exact):"
    return [head, *(f"  {line}" for line in lines)]


def _fewer(base: Estimate, est: Estimate) -> str:
    if est.wan_bytes_per_step <= 0:
        return "no WAN bytes"
    return f"{base.wan_bytes_per_step / est.wan_bytes_per_step:.1f}x fewer WAN bytes"


def _status(layout: LayoutSpec) -> str:
    """Whether the planner may choose the layout's lossy encoding, in a few words."""
    why = not_chosen(layout)
    if why is None:
        return ": within tolerance"
    return ": shown, not chosen" if why.endswith("unmeasured") else ": over tolerance, not chosen"
