"""Prefill as a service in a training run's pipeline bubbles (``[bubbles]``), and the per-rank
busy/idle timeline (``metrics.timeline``).

:class:`BubbleRun` is one of the trainer's step hooks (`isthmus.train.hooks.StepHooks`): it reads
the requests, builds the serving model, hooks the pipeline stages (``parallel.bubbles``), marks
steps and the step's ops on the timeline, fills the step's waits, reports each rank's busy fraction
per step, and at the end writes ``<run_dir>/prefill.jsonl`` and the trace. The serving model is a
separate, frozen module that fits the memory training leaves spare: the run's own shape at the
weights it starts from, or a named flavor; it is not the weights being trained, which are split over
the pipeline ranks and change every step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from isthmus.config import JobConfig, synthetic_spec
from isthmus.data.tokenizer import Tokenizer
from isthmus.errors import full_disk_as
from isthmus.log import get_logger
from isthmus.models.args import ModelArgs
from isthmus.models.flavors import get_flavor
from isthmus.models.llama import build_model, init_weights
from isthmus.parallel.bubbles import BubbleFiller, Request, Timeline, fill_stage, prefill, time_stage
from isthmus.parallel.pipeline import local_stages
from isthmus.serve.requests import RequestLimits, check_request_length, check_synthetic, read_request_file


def synthetic_requests(n: int, length: int, vocab: int, seed: int) -> list[Request]:
    """``n`` prompts of ``length`` token ids drawn from their own generator (training's RNG untouched)."""
    gen = torch.Generator().manual_seed(seed)
    return [Request(f"s{i}", torch.randint(vocab, (length,), generator=gen).tolist()) for i in range(n)]


def load_requests(cfg: JobConfig, tokenizer: Tokenizer, vocab: int) -> list[Request]:
    """bubbles.prefill's requests as token ids. Preflight checked them before any rank started; a
    prompt's length is checked again here, where it is first known for a tokenizer trained by the run."""
    limits = RequestLimits(max_tokens=cfg.train.seq_len)
    spec = synthetic_spec(cfg.bubbles.prefill)
    if spec is not None:
        check_synthetic(cfg.bubbles.prefill, *spec, limits)
        return synthetic_requests(*spec, vocab, cfg.train.seed)
    path = Path(cfg.bubbles.prefill)
    out = []
    for r in read_request_file(path, vocab, limits):
        tokens = r.tokens if r.tokens is not None else tokenizer.encode(r.prompt or "")
        check_request_length(f"bubbles.prefill: {path}:{r.line}", r.id, len(tokens), limits)
        out.append(Request(r.id, tokens))
    return out


def serving_model(cfg: JobConfig, run_args: ModelArgs, vocab: int, device: torch.device) -> nn.Module:
    """The frozen model that serves the requests (see the module docstring)."""
    if cfg.bubbles.model:
        args = get_flavor(cfg.bubbles.model).with_overrides(vocab_size=vocab)
    else:
        args = run_args
    model = build_model(args, device="meta").to_empty(device=device)
    if cfg.bubbles.model or not cfg.model.init_from:
        init_weights(model, cfg.train.seed, args)
    else:
        from isthmus.weights.init_from import load_weights, open_weights

        with torch.no_grad():
            load_weights([model], open_weights(cfg.model.init_from, args))
    model.eval().requires_grad_(False)
    return model


def prefill_alone(run_dir: Path) -> dict[str, dict[str, Any]]:
    """Every request of a finished run's ``bubbles.prefill``, prefilled again outside training: the
    run's resolved config and tokenizer, its ranks' thread count, the same prefill function. What
    the run served in its bubbles must equal this, request by request (filling changes no value)."""
    from isthmus.config import build_config
    from isthmus.data.tokenizer import load_tokenizer
    from isthmus.models.resolve import resolve_model_args

    cfg = build_config(run_dir / "config.toml", [])
    tokenizer = load_tokenizer(run_dir)
    cpu = torch.device("cpu")
    model = serving_model(cfg, resolve_model_args(cfg.model, tokenizer.vocab_size), tokenizer.vocab_size, cpu)
    requests = load_requests(cfg, tokenizer, tokenizer.vocab_size)
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.train.threads or before)
    try:
        return {r.id: prefill(model, r.tokens, cpu) for r in requests}
    finally:
        torch.set_num_threads(before)


class BubbleRun:
    """Bubble filling and the timeline, as the trainer's step hook (one per rank)."""

    def __init__(
        self,
        cfg: JobConfig,
        schedule: Any,
        run_args: ModelArgs,
        tokenizer: Tokenizer,
        device: torch.device,
        rank: int,
        world: int,
        run_dir: Path,
    ) -> None:
        self.cfg, self.rank, self.world, self.run_dir = cfg, rank, world, run_dir
        self.timeline = Timeline()
        self.filler: BubbleFiller | None = None
        self._window_start: float | None = None
        self.pipelined = schedule is not None
        """Whether the pipeline stages record their own forward and backward chunks."""
        self.serving = bool(cfg.bubbles.prefill) and schedule is not None
        if schedule is None:
            return
        model: nn.Module | None = None
        mine: list[Request] = []
        if self.serving:
            vocab = tokenizer.vocab_size
            requests = load_requests(cfg, tokenizer, vocab)
            mine = requests[rank::world]  # every rank serves its own share, in order
            model = serving_model(cfg, run_args, vocab, device)
            get_logger().info(
                "bubbles: %d of %d prefill request(s) on rank %d, served by %s",
                len(mine),
                len(requests),
                rank,
                cfg.bubbles.model or "the run's initial weights",
            )
        # Without requests the filler only records the waits, so that a timeline without filling
        # shows them too (and runs with and without filling go through the same hook).
        self.filler = BubbleFiller(model, mine, device, self.timeline)
        self.filler.calibrate()
        for st in local_stages(schedule):
            time_stage(st, self.timeline)
            # Last: it wraps what the other hooks (WAN byte counting, striping) left on the factories.
            fill_stage(st, self.filler)

    def begin_step(self, step: int) -> None:
        # Each step's window starts where the previous one ended, so that every second of the run
        # (the metrics' own collectives, logging, checkpoints) falls in some step's busy fraction.
        if self._window_start is None:
            self._window_start = time.perf_counter()
        if self.filler is not None:
            self.filler.begin_step(step)

    def span(self, what: str) -> AbstractContextManager[Any]:
        """A training op on the timeline (a pipeline's forward and backward are its stages')."""
        if what == "forward+backward" and self.pipelined:
            return nullcontext()
        return self.timeline.span(what, "optimizer" if what == "optimizer" else "forward")

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        """Nothing: the serving model is not the one trained."""

    def wait(self, work: Any, name: str, inner: Callable[[Any, str], None]) -> None:
        """Wait for a collective of the step (gradient norm, loss), filling the wait when filling
        (the filler then waits for ``work`` itself)."""
        if self.filler is not None:
            self.filler.wait(work, name)
        else:
            with self.timeline.span(name, "wait"):
                inner(work, name)

    def after_optimizer_step(self, step: int, params: list[nn.Parameter]) -> None:
        """Nothing: the serving model is not the one trained."""

    def end_step(self, step: int) -> dict[str, Any]:
        """This step's busy fraction of every rank, and the prefill tokens served in its bubbles
        (summed over ranks). A collective, every rank calls it once per step; its wait counts towards
        the next step's window but is not filled: a request served in it would be served after its
        step's tokens were counted, and after the last step never counted at all."""
        start, end = self._window_start, time.perf_counter()
        assert start is not None, "end_step without begin_step"
        self._window_start = end
        self.timeline.add(f"step {step}", "step", start, end)
        tokens = 0
        if self.filler is not None:
            tokens, self.filler.tokens_this_step = self.filler.tokens_this_step, 0
        mine = torch.tensor([self.timeline.busy_fraction(start, end), float(tokens)], dtype=torch.float64)
        if self.world > 1:
            every = [torch.zeros_like(mine) for _ in range(self.world)]
            work = dist.all_gather(every, mine, async_op=True)
            assert work is not None
            with self.timeline.span("all-gather busy", "wait"):
                work.wait()
        else:
            every = [mine]
        out: dict[str, Any] = {"busy": [round(float(t[0]), 4) for t in every]}
        if self.serving:
            out["prefill_tokens"] = int(sum(float(t[1]) for t in every))
        return out

    def finish(self, params: list[nn.Parameter]) -> None:
        """Serve what no bubble had room for, then rank 0 writes prefill.jsonl and the trace from
        every rank's part. A collective."""
        if self.filler is not None:
            left = self.filler.flush()
            if left:
                get_logger().info(
                    "bubbles: %d request(s) on rank %d had no bubble; served after training", left, self.rank
                )
        parts: list[Any] = [None] * self.world
        mine = {
            "results": [dict(r, rank=self.rank) for r in self.filler.results] if self.filler is not None else [],
            "events": self.timeline.chrome_events(self.rank + 1, f"rank {self.rank}"),
        }
        if self.world > 1:
            # Pickled, but only our own lists and dicts of numbers and strings, between the ranks of
            # one run: nothing a user supplies is unpickled.
            dist.all_gather_object(parts, mine)
        else:
            parts = [mine]
        if self.rank != 0:
            return
        if self.serving:
            results = sorted((r for p in parts for r in p["results"]), key=lambda r: _order(r["id"]))
            out = self.run_dir / "prefill.jsonl"
            with full_disk_as("prefill results", out, "train.run_dir"), out.open("w") as f:
                for r in results:
                    f.write(json.dumps(r) + "\n")
        if self.cfg.metrics.timeline:
            events = [e for p in parts for e in p["events"]]
            trace = Path(self.cfg.metrics.timeline)
            with full_disk_as("timeline", trace, "metrics.timeline"):
                trace.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))


def _order(request_id: str) -> tuple[int, str]:
    # s2 before s10 for synthetic ids; others by name.
    digits = request_id[1:] if request_id[:1] == "s" else ""
    return (int(digits), "") if digits.isdigit() else (1 << 62, request_id)


def build_bubble_run(
    cfg: JobConfig,
    schedule: Any,
    run_args: ModelArgs,
    tokenizer: Tokenizer,
    device: torch.device,
    rank: int,
    world: int,
    run_dir: Path,
) -> BubbleRun | None:
    """The run's BubbleRun, or None when neither bubbles.prefill nor metrics.timeline is set."""
    if not cfg.bubbles.prefill and not cfg.metrics.timeline:
        return None
    # The serving model's initialisation and the synthetic prompts draw from their own generators;
    # fork_rng keeps the global RNG as training left it all the same.
    with torch.random.fork_rng(devices=[]):
        return BubbleRun(cfg, schedule, run_args, tokenizer, device, rank, world, run_dir)
