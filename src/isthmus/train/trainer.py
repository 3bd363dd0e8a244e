"""The training loop: one optimizer step read top to bottom in `Trainer.train_step`.

The trainer never decides a layout: `apply_layout` gives it this rank's model parts, and the mesh
tells it which slice of each global batch (data-parallel rank) and which sequence chunks
(context-parallel rank) this process computes. The same code runs one process or many.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import deque
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from isthmus.checkpoint.manifest import checkpoint_key, resume_note
from isthmus.checkpoint.state import Checkpointer, ResumePoint, TrainState
from isthmus.config import JobConfig
from isthmus.data.corpus import PreparedData, prepare_data
from isthmus.data.loader import BatchSampler, val_batches
from isthmus.errors import ConfigError, RunFailed, full_disk_as
from isthmus.geo.run import build_geo_run
from isthmus.layout.dims import ParallelDims, check_layout
from isthmus.layout.spec import LayoutSpec
from isthmus.log import get_logger
from isthmus.models.flops import count_params, flops_per_token
from isthmus.models.llama import build_model
from isthmus.models.resolve import resolve_model_args
from isthmus.parallel.parallelize import ParallelModel, apply_layout
from isthmus.parallel.rendezvous import group_store_args
from isthmus.profile.device import (
    correct_peak,
    describe_hosts,
    describe_peak,
    devices_worth,
    job_devices,
    peak_flops,
    resolve_device,
    this_rank_peak,
)
from isthmus.serve.prefill import build_bubble_run
from isthmus.train.experts import ExpertBalance
from isthmus.train.grad import clip_grad_norm
from isthmus.train.hooks import StepHookList
from isthmus.train.membership import (
    HOSTS_FILE,
    HostChange,
    gather_hosts,
    host_change,
    last_logged_step,
    multi_node,
    read_hosts,
    resume_line,
    write_hosts,
)
from isthmus.train.metrics import MetricsLogger, ThroughputModel
from isthmus.train.optim import build_lr_scheduler, build_optimizer
from isthmus.train.short_run import max_steps_override
from isthmus.train.step import forward_backward, loss_context, loss_function, shard_batch
from isthmus.train.step_sum import RoundStep, RoundSum, StepSum
from isthmus.weights.final_model import gather_full_state, save_final_model
from isthmus.weights.init_from import load_weights, open_weights


@dataclass
class TrainResult:
    """What a finished run reports back (rank 0's view)."""

    run_dir: Path
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    """Global gradient norm before clipping, per step."""
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    flops_per_device: float = 0.0
    """Model FLOP/s one device achieved (the numerator of MFU)."""
    peak_flops: float = 0.0
    """The peak FLOP/s of one device that MFU divides by, and where it comes from."""
    peak_source: str = ""
    elapsed_s: float = 0.0
    n_params: int = 0
    world_size: int = 1
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    """Bytes sent by all ranks per link tier (intra_node, intra_dc, wan) by the geo strategy."""


@dataclass
class Progress:
    """What a running trainer reports outside itself: the last optimizer step it finished."""

    step: int = 0
    changed: threading.Event = field(default_factory=threading.Event)
    """Set at each new step, for a watcher that reports it at once (the launcher's heartbeat)."""

    def advance(self, step: int) -> None:
        self.step = step
        self.changed.set()


@dataclass
class _OpenStep:
    """A finished optimizer step whose loss is still being summed over ranks."""

    step: int
    lr: float
    seconds: float
    sum: StepSum | RoundStep
    grad_norm: float
    extra: dict[str, Any]


def init_distributed(backend: str, device: torch.device) -> tuple[int, bool]:
    """Join the process group the launcher prepared (RANK/WORLD_SIZE in the environment).

    Returns the world size and whether this call made the default group (then the run destroys it
    at its end; a group the caller made is the caller's to keep or destroy).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, **group_store_args(world))
        return world, True
    return world, False


class Trainer:
    """Builds everything for one run from a validated `JobConfig` and trains it."""

    def __init__(self, cfg: JobConfig, progress: Progress | None = None) -> None:
        self.cfg = cfg
        self.progress = progress if progress is not None else Progress()
        self.log = get_logger()
        t, p = cfg.train, cfg.parallel
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.world, self.owns_group = init_distributed(p.backend, self.device)
        self.rank = dist.get_rank() if self.world > 1 else 0
        # The whole run, or (geo.fault_tolerant) one datacenter's job of it: the layout checked
        # below is still the whole run's.
        self.geo_run = build_geo_run(cfg.geo)
        self._round: RoundSum | None = None
        """Under DiLoCo across datacenters: the outer round whose steps' sums are being gathered."""
        self.run_dir = self.geo_run.run_dir(Path(t.run_dir))
        self.data = self._prepare_data()
        self.model_args = a = resolve_model_args(cfg.model, self.data.tokenizer.vocab_size)
        # Under torchrun on several nodes, each rank's host, for the line an elastic restart prints.
        self.hosts = self._gather_hosts()
        self.dims: ParallelDims = check_layout(
            cfg,
            a.n_heads,
            a.n_kv_heads,
            a.n_layers,
            world_size=self.geo_run.layout_world(self.world),
            n_experts=a.n_experts,
            capacity_factor=a.capacity_factor,
        )
        self.layout = LayoutSpec.from_config(cfg)
        self.mesh = self.dims.build_mesh(self.device.type) if self.world > 1 and self.geo_run.whole_run else None
        # Verified (on rank 0) before the model exists: a bad checkpoint fails in seconds, not minutes.
        self.checkpointer = Checkpointer(
            cfg.checkpoint, self.run_dir, a, self.layout.manifest(self.dims.world_size), cfg.to_toml(), self.world
        )
        resume = self.checkpointer.find_resume()
        self._note_hosts(resume)
        # Checked before the model exists too; a resumed run takes its weights from the checkpoint.
        pretrained = None
        if cfg.model.init_from and resume is None:
            pretrained = open_weights(cfg.model.init_from, a, checkpoint_key(cfg.checkpoint.key_file))
        self._write_run_files(resume)
        self.loss_fn = loss_function(t.compile, self.dims.tp_enabled)
        self.pm: ParallelModel = apply_layout(
            build_model(a, device="meta"),
            self.dims,
            p,
            self.mesh,
            device=self.device,
            seed=t.seed,
            seq_len=t.seq_len,
            loss_fn=self.loss_fn,
            geo_sync=cfg.geo.sync != "none",
            dtype=t.dtype,
            compile=t.compile,
        )
        if pretrained is not None:
            load_weights(self.pm.modules, pretrained)
        self.geo_run.wire_pipeline(self.pm.schedule, self.dims.pp, self.mesh)
        # After wire_pipeline: its hooks on the stages' P2P ops are wrapped, not replaced.
        bubbles = build_bubble_run(
            cfg, self.pm.schedule, a, self.data.tokenizer, self.device, self.rank, self.world, self.run_dir
        )
        # What only some runs do in a step: geo.sync (through the geo run, which owns it), then the
        # timeline and bubble filling (bubbles.prefill, metrics.timeline).
        self.hooks = StepHookList([self.geo_run] if bubbles is None else [self.geo_run, bubbles])
        if a.is_moe:
            # Expert loads in the metrics and the bias method's update after each optimizer step.
            # The ranks of this process group that see different tokens (one datacenter's share of the
            # layout under geo.fault_tolerant, whose datacenters update their biases apart).
            data_ranks = self.dims.dp * self.dims.cp * self.world // self.dims.world_size
            self.hooks.hooks.append(ExpertBalance(self.pm.moe, a, data_ranks, self.world, self.device))
        zero1_group = self._mesh_group("dp_cp") if self.pm.dp_kind == "zero1" else None
        shard_group = self._mesh_group("dp_shard_cp") if self.pm.sharded_optimizer else None
        self.optimizer = build_optimizer(self.pm.modules, t, zero1_group, shard_group)
        self.scheduler = build_lr_scheduler(self.optimizer, t)
        self.sampler = BatchSampler(self.data.train, t.seq_len, t.seed)
        mesh_dp_rank = self.mesh["dp"].get_local_rank() if self.mesh is not None else 0
        self.dp_rank = self.geo_run.dp_rank(mesh_dp_rank, self.rank, self.world)
        self.cp_rank = self.mesh["cp"].get_local_rank() if self.mesh is not None else 0
        self._restore(resume)
        self.n_params = count_params(a)
        self.log.info(
            "model %s: %s parameters (%s); %s train / %s val tokens (%s tokenizer, vocab %d); layout %s over %d rank(s)",
            f"from {cfg.model.init_from}" if cfg.model.init_from else cfg.model.flavor,
            f"{self.n_params:,}",
            _shape_str(a),
            f"{len(self.data.train):,}",
            f"{len(self.data.val):,}",
            self.data.tokenizer.kind,
            self.data.tokenizer.vocab_size,
            self.layout.describe(),
            self.world,
        )

    # --- helpers --------------------------------------------------------------------------
    def _prepare_data(self) -> PreparedData:
        """The tokenised corpus. Rank 0 makes the run folder and fills the cache first; the others
        then read it instead of redoing it."""
        seq_len = self.cfg.train.seq_len
        if self.rank == 0:
            with full_disk_as("run folder", self.run_dir, "train.run_dir"):
                self.run_dir.mkdir(parents=True, exist_ok=True)
            data = prepare_data(self.cfg.data, seq_len)
        self._barrier()
        return data if self.rank == 0 else prepare_data(self.cfg.data, seq_len)

    def _gather_hosts(self) -> list[str] | None:
        """Every rank's hostname, in a multi-node run or one that continues such a run (None otherwise)."""
        record = self.run_dir / "logs" / HOSTS_FILE
        if not self.geo_run.whole_run or not (multi_node() or record.exists()):
            return None
        return gather_hosts(self.world)

    def _host_change(self) -> HostChange | None:
        """Which hosts left or joined since the run's last start (None: none, or nothing to compare)."""
        before = read_hosts(self.run_dir / "logs" / HOSTS_FILE) if self.hosts is not None else None
        if before is None or self.hosts is None:
            return None
        return host_change(before, self.hosts) or None

    def _note_hosts(self, resume: ResumePoint | None) -> None:
        """Rank 0: say which hosts left or joined, what was lost and where the run goes on; record the hosts."""
        if self.rank != 0 or self.hosts is None:
            return
        change = self._host_change()
        if change is not None:
            metrics = Path(self.cfg.metrics.jsonl) if self.cfg.metrics.jsonl else self.run_dir / "metrics.jsonl"
            step = resume.manifest.step if resume is not None else None
            line = resume_line(change, step, last_logged_step(metrics), self.world, self.dims.dp)
            self.log.warning("%s", line)
        write_hosts(self.run_dir / "logs" / HOSTS_FILE, self.hosts)

    def _write_run_files(self, resume: ResumePoint | None) -> None:
        """The config and tokenizer into the run folder (rank 0), once the checkpoint to resume
        from is known: a run refused here leaves an earlier run's files as they were."""
        t = self.cfg.train
        if self.rank == 0:
            with full_disk_as("config", self.run_dir / "config.toml", "train.run_dir"):
                (self.run_dir / "config.toml").write_text(self.cfg.to_toml())
            with full_disk_as("tokenizer", self.run_dir, "train.run_dir"):
                self.data.tokenizer.save(self.run_dir)
        if resume is not None and resume.manifest.step >= t.steps:
            at = resume.manifest.step
            raise ConfigError(
                "train.steps", t.steps, f"the checkpoint {resume.path} is at step {at} already; raise it to train on"
            )

    def _restore(self, resume: ResumePoint | None) -> None:
        """Load the checkpoint to resume from (if any) and build the geo run's cross-datacenter
        strategy (geo.sync) with its state from the checkpoint."""
        n_dc = self.dims.datacenters
        self.train_state = TrainState(
            self.pm.modules,
            self.optimizer,
            self.scheduler,
            self.sampler,
            replica=self.geo_run.replica_key(n_dc, self.rank, self.world),
        )
        self.step = self.checkpointer.load(resume, self.train_state) if resume is not None else 0
        self.progress.advance(self.step)
        _apply_step_cap(self.cfg.train, self.step)
        # Built from the loaded model, so a checkpoint without geo state starts geo.sync from it.
        sync = self.geo_run.build_sync(self.pm.parameters(), self.dims, self.world)
        self.train_state.geo = sync
        if resume is not None and sync is not None:
            self.checkpointer.load_geo(resume, sync)

    def _skip_to(self, step: int) -> None:
        """Continue at ``step`` as if the steps before it had run here: learning rate and data position."""
        import warnings

        if step <= self.step:
            return
        with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()": on purpose
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step - self.step):
                self.scheduler.step()
        epoch, offset = divmod(step * self.cfg.train.batch_size, self.sampler.n_windows)
        self.sampler.load_state_dict({"epoch": epoch, "offset": offset})
        self.step = step

    def _set_timeouts(self) -> None:
        """parallel.timeout_s for every process group this rank uses, once the first step ran.

        Not from the start: before it, rank 0 may tokenise a large corpus while the others wait, and
        the first step builds what later steps reuse (torchtitan does the same). A rank that stops
        answering meanwhile is found by the launcher's heartbeats, which need no timeout here.
        """
        if self.world == 1:
            return
        groups: list[Any] = [None]  # the default group
        if self.mesh is not None:
            groups += self.mesh.root.get_all_groups() + [m.get_group() for m in self.mesh.flat.values()]
        if self.checkpointer.group is not None:
            groups.append(self.checkpointer.group)
        set_group_timeouts(self.cfg.parallel.timeout_s, groups)

    def _check_finite(self, loss: float, grad_norm: float, lr: float, step: int) -> None:
        """Stop at the first non-finite loss or gradient norm, before the step's metrics or checkpoint.

        Every rank sees the same values (both are reduced over ranks), so every rank stops here. A save
        still in flight holds the state of a finite step: it is committed first, to resume from.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        self.checkpointer.wait()
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm} (loss {loss:.4f})"
        t = self.cfg.train
        change = f"lower train.lr (now {lr:g})" + (" or train.dtype = fp32" if t.dtype == "bf16" else "")
        raise RunFailed(
            f"{what} at step {step}; {resume_note(self.checkpointer.root, self.cfg.checkpoint.every)}; {change}"
        )

    def _mesh_group(self, dim: str) -> dist.ProcessGroup:
        assert self.mesh is not None, f"the {dim} group needs the device mesh"
        return self.mesh[dim].get_group()

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def _local_batch(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's sequence chunks (context parallel), on the device."""
        inputs, targets = shard_batch(self.pm, inputs, targets, self.cp_rank)
        return inputs.to(self.device), targets.to(self.device)

    def _grad_sync(self, enabled: bool) -> AbstractContextManager[Any]:
        """Skip gradient communication on all but the last micro-step of an accumulation."""
        module: Any = self.pm.modules[0]  # DistributedDataParallel or an FSDP module, typed nn.Module
        if self.pm.dp_kind in ("ddp", "zero1") and not enabled:
            return module.no_sync()
        if self.pm.dp_kind == "fsdp" and self.pm.schedule is None:
            module.set_requires_gradient_sync(enabled)
        return nullcontext()

    def _mean_over_ranks(self, local: torch.Tensor | None) -> float:
        """Average a per-rank loss over the ranks that computed one (last pipeline stage; every dp/cp rank)."""
        return StepSum(local, (), self.world).loss

    # --- one optimizer step -------------------------------------------------------------
    def train_step(self) -> tuple[StepSum | RoundStep, float]:
        """Batch, forward/backward, reduce, clip, optimizer step. Returns the step's loss on its way
        to the mean over ranks (with the step's byte counters; `StepSum`) and the gradient norm."""
        t = self.cfg.train
        inputs, targets = self._local_batch(*self.sampler.next_batch(t.batch_size, self.dp_rank, self.dims.dp))
        losses = self._forward_backward(inputs, targets)
        # DDP and FSDP reduced the gradients during backward; with geo.sync its strategy does, here.
        self.hooks.reduce_gradients(self.pm.parameters())
        pp_group = self._mesh_group("pp") if self.dims.pp_enabled else None
        max_norm = t.grad_clip if t.grad_clip > 0 else math.inf
        grad_norm = clip_grad_norm(self.pm.parameters(), max_norm, pp_group, self.hooks.wait)
        with self.hooks.span("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        self.hooks.after_optimizer_step(self.step, self.pm.parameters())
        local = torch.stack(losses).mean() if losses else None
        step_sum = self._step_sum(local, self.step == t.steps)
        if step_sum.eventually:
            # DiLoCo: the job's loss arrives up to an outer round later; check this rank's now (a NaN
            # loss in the datacenter makes its gradients, and so each of its ranks' norm, NaN too).
            self._check_finite(float(local) if local is not None else 0.0, grad_norm, t.lr, self.step)
        return step_sum, grad_norm

    def _step_sum(self, local: torch.Tensor | None, last: bool) -> StepSum | RoundStep:
        """The step just taken's loss and byte counters (this rank's) on their way to the sum over
        every rank: an all-reduce of each step's own, except under DiLoCo across datacenters
        (`GeoRun.sums_per_round`), whose inner steps must not wait on the WAN: the steps of an outer
        round share one all-reduce, started at the round's last step (every ``geo.inner_steps``-th,
        and the run's last), which `_close_due` collects whenever it is in."""
        counters = self.geo_run.step_counters()
        if not self.geo_run.sums_per_round:
            return StepSum(local, counters, self.world)
        if self._round is None or self._round.started:  # started: needed before the round's end
            self._round = RoundSum(self.world)
        out = self._round.add(local, counters)
        if self.step % self.cfg.geo.inner_steps == 0 or last:
            self._round.start()
        return out

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        """Forward and backward over grad_accum micro-batches, gradients accumulated; returns the
        losses this rank computed (none on a pipeline stage before the last)."""
        accum = self.cfg.train.grad_accum
        # Equal-sized micro-batches, each loss scaled by 1/accum: the accumulated gradient is the
        # gradient of the mean loss over the whole batch, exactly as without accumulation.
        scale = 1.0 if self.pm.schedule is not None else 1.0 / accum
        losses: list[torch.Tensor] = []
        chunks = list(zip(inputs.chunk(accum), targets.chunk(accum)))
        for i, (x, y) in enumerate(chunks):
            with (
                self._grad_sync(i == len(chunks) - 1),
                self.pm.compute_precision(self.device.type),
                self.hooks.span("forward+backward"),
            ):
                loss = forward_backward(self.pm, x, y, scale, self.loss_fn)
            if loss is not None:
                losses.append(loss)
        if self.pm.schedule is not None and accum > 1:
            # Each schedule step averages over its micro-batches; average over the accumulation too.
            _scale_grads(self.pm.parameters(), 1.0 / accum)
        return losses

    @torch.no_grad()
    def validate(self) -> float:
        t = self.cfg.train
        for m in self.pm.modules:
            m.eval()
        losses = []
        for x, y in val_batches(self.data.val, t.seq_len, t.batch_size, t.val_batches, self.dp_rank, self.dims.dp):
            x, y = self._local_batch(x, y)
            with loss_context(self.pm), self.pm.compute_precision(self.device.type):
                if self.pm.schedule is not None:
                    from isthmus.parallel.pipeline import pipeline_eval

                    loss = pipeline_eval(self.pm.schedule, x, y, self.pm.has_first_stage, self.pm.has_last_stage)
                else:
                    loss = self.loss_fn(self.pm.model(x), y)
            losses.append(self._mean_over_ranks(loss))
        for m in self.pm.modules:
            m.train()
        return sum(losses) / len(losses)

    def _throughput(self) -> ThroughputModel:
        """Tokens per step, FLOPs per token and the devices' peak: what MFU is computed from."""
        t = self.cfg.train
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", self.world))
        peak = peak_flops(self.device, t.dtype)
        devices = devices_worth(self.world, local_world, torch.get_num_threads(), self.device)
        if self.device.type == "cpu" and self.world > local_world and self.geo_run.whole_run:
            devices = self._hosts_devices(peak)
        return ThroughputModel(
            tokens_per_step=self.geo_run.tokens_per_step(t.batch_size * t.seq_len),
            flops_per_token=flops_per_token(self.model_args, t.seq_len),
            peak_flops=peak,
            devices=devices,
            # Rank 0 alone reports MFU, so it alone corrects a peak that a step proves wrong.
            correct_peak=partial(correct_peak, self.device, t.dtype) if self.rank == 0 else None,
        )

    def _hosts_devices(self, peak: float) -> float:
        """Ranks on several hosts (torchrun's nodes): each host's cores and peak count, not rank 0's
        machine times the world. One gather of every rank's host, cores, threads and peak."""
        ranks: list[Any] = [None] * self.world
        dist.all_gather_object(ranks, this_rank_peak(peak))
        hosts = len({r.host for r in ranks})
        if self.rank == 0 and hosts > 1:
            self.log.info("MFU peak over %d hosts: %s", hosts, describe_hosts(ranks))
        return job_devices(ranks, peak)

    # --- the loop -----------------------------------------------------------------------
    def fit(self) -> TrainResult:
        t = self.cfg.train
        # Meet the other datacenters first (geo.fault_tolerant): one that (re)starts late continues
        # at the others' step.
        self._skip_to(self.geo_run.join(self.pm.parameters()))
        throughput = self._throughput()
        metrics = self._metrics_logger(throughput)
        result = TrainResult(run_dir=self.run_dir, n_params=self.n_params, world_size=self.world)
        step_times: list[float] = []
        start = time.perf_counter()
        # The steps whose losses are still being summed over ranks, oldest first: each closed
        # (logged) after the next step has computed, so that the sum crosses the network behind it,
        # or under DiLoCo, the job-wide sum once it is in (see train/step_sum.py and `_close_due`).
        open_steps: deque[_OpenStep] = deque()
        try:
            while self.step < t.steps:
                step_start = time.perf_counter()
                lr = float(self.scheduler.get_last_lr()[0])
                self.hooks.begin_step(self.step + 1)
                step_sum, grad_norm = self.train_step()
                self._close_due(open_steps, result, metrics)
                step_times.append(time.perf_counter() - step_start)
                self.progress.advance(self.step)
                if len(step_times) == 1:
                    self._set_timeouts()
                # The outer round's quorum and the busy fractions (a collective of their own) are
                # the step's own: taken at its end, not when its sums arrive.
                extra = self.hooks.end_step(self.step)
                open_steps.append(_OpenStep(self.step, lr, step_times[-1], step_sum, grad_norm, extra))
                validate = bool(t.val_every and self.step % t.val_every == 0) or self.step == t.steps
                save = self.checkpointer.due(self.step, last=self.step == t.steps)
                if validate or save:
                    # Both see the state after this step, and a checkpoint only a finite one.
                    while open_steps:
                        self._close_step(open_steps.popleft(), result, metrics)
                if validate:
                    val = self.validate()
                    result.val_losses.append((self.step, val))
                    if metrics is not None:
                        metrics.log_val(self.step, val)
                self.checkpointer.poll()
                if save:
                    self.checkpointer.save(self.step, self.train_state)
            while open_steps:
                self._close_step(open_steps.popleft(), result, metrics)
        except BaseException:
            self.checkpointer.abandon()
            raise
        finally:
            if metrics is not None:
                metrics.close()
        self.checkpointer.wait()
        self.hooks.finish(self.pm.parameters())
        result.bytes_by_tier = self.geo_run.bytes_by_tier
        result.elapsed_s = time.perf_counter() - start
        # The first step warms up the allocator and kernels (and pipeline shape inference): leave it out.
        timed = step_times[1:] or step_times
        # No step at all: a datacenter that (re)joined the others at their last outer sync.
        result.tokens_per_s = throughput.tokens_per_step * len(timed) / sum(timed) if timed else 0.0
        result.mfu = throughput.mfu(result.tokens_per_s)
        result.flops_per_device = throughput.flops_per_device(result.tokens_per_s)
        result.peak_flops = throughput.peak_flops
        result.peak_source = describe_peak(self.device, t.dtype)
        self._save_final_model()
        return result

    def _close_due(self, open_steps: deque[_OpenStep], result: TrainResult, metrics: MetricsLogger | None) -> None:
        """Close the open steps, oldest first, that are due now that a later step has computed:
        each one, waiting for its sum, except a job-wide sum under DiLoCo (`StepSum.eventually`)
        not in yet, which (with the steps after it, logged in order) stays open until the next
        outer round has ended too (the oldest round's steps and the next round's, at most
        2 x ``geo.inner_steps`` open): no inner step waits on the WAN."""
        while open_steps:
            oldest = open_steps[0].sum
            if oldest.eventually and not oldest.done() and len(open_steps) <= 2 * self.cfg.geo.inner_steps:
                return
            self._close_step(open_steps.popleft(), result, metrics)

    def _close_step(self, done: _OpenStep, result: TrainResult, metrics: MetricsLogger | None) -> None:
        """Collect a step's loss and byte counts summed over ranks; check and log them."""
        done.sum.wait(self.hooks.wait)
        self._check_finite(done.sum.loss, done.grad_norm, self.cfg.train.lr, done.step)
        result.losses.append(done.sum.loss)
        result.grad_norms.append(done.grad_norm)
        # Bytes this step sent per link tier.
        extra: dict[str, Any] = {"grad_norm": done.grad_norm, **self.geo_run.step_metrics(done.sum.counters)}
        extra.update(done.extra)
        if metrics is not None:
            metrics.log_step(done.step, done.sum.loss, done.lr, done.seconds, extra)

    def _metrics_logger(self, throughput: ThroughputModel) -> MetricsLogger | None:
        """Rank 0's metrics logger (None on the others)."""
        if self.rank != 0:
            return None
        mcfg = self.geo_run.metrics_config(self.cfg.metrics)
        return MetricsLogger(mcfg, self.run_dir, self.cfg.train.steps, throughput, self.device, self.step)

    def _save_final_model(self) -> None:
        """The full model, gathered from every rank, written by rank 0 to <run_dir>/final."""
        state = gather_full_state(self.pm.modules, self.world)
        if self.rank == 0:
            key = checkpoint_key(self.cfg.checkpoint.key_file)
            save_final_model(state, self.model_args, self.run_dir / "final", key)
        self._barrier()


def _apply_step_cap(t: Any, start: int) -> None:
    cap = max_steps_override()
    if cap is not None:
        t.steps = min(t.steps, start + cap)


def set_group_timeouts(timeout_s: float, groups: list[Any]) -> None:
    """A collective on any of ``groups`` (None: the default group) fails after ``timeout_s`` seconds.

    Groups made by DeviceMesh and ``new_group`` take torch's 30-minute default, not the default
    group's timeout, so each is set. torch's only way to change the timeout of a group already made
    is private (torchtitan uses it too).
    """
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    for group in groups:
        _set_pg_timeout(timedelta(seconds=timeout_s), group)


def _scale_grads(params: list[torch.nn.Parameter], factor: float) -> None:
    for p in params:
        if p.grad is not None:
            p.grad.mul_(factor)


def _shape_str(args: Any) -> str:
    return f"dim {args.dim}, {args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} heads, ffn {args.ffn_dim}, {args.mlp}"


def train(cfg: JobConfig, progress: Progress | None = None) -> TrainResult:
    """Train one run described by ``cfg`` in this process (one rank of it, when launched with several).

    ``progress`` follows the last finished step, for whoever watches the run (the launcher's heartbeat).
    """
    trainer = Trainer(cfg, progress)
    try:
        return trainer.fit()
    finally:
        if trainer.owns_group and dist.is_initialized():
            dist.destroy_process_group()
