"""The training loop: one optimizer step read top to bottom in `Trainer.train_step`.

The trainer never decides a layout; it receives the model it is given and the data-parallel
rank/size that decide which slice of each global batch this process computes.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from isthmus.config import JobConfig
from isthmus.data.corpus import prepare_data
from isthmus.data.loader import BatchSampler, val_batches
from isthmus.log import get_logger
from isthmus.models.flops import count_params, flops_per_token
from isthmus.models.llama import build_model, init_weights
from isthmus.models.resolve import resolve_model_args
from isthmus.train.checkpoint import save_final_model
from isthmus.train.device import peak_flops, resolve_device
from isthmus.train.metrics import MetricsLogger, ThroughputModel
from isthmus.train.optim import build_lr_scheduler, build_optimizer


@dataclass
class TrainResult:
    """What a finished run reports back (rank 0's view)."""

    run_dir: Path
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    elapsed_s: float = 0.0
    n_params: int = 0


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss; fp32 logits so bf16 runs reduce in full precision."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))


class Trainer:
    """Builds everything for one run from a validated `JobConfig` and trains it."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg
        self.log = get_logger()
        t = cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        self.device = resolve_device(t.device)
        self.run_dir = Path(t.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.toml").write_text(cfg.to_toml())

        self.data = prepare_data(cfg.data, t.seq_len)
        self.model_args = resolve_model_args(cfg.model, self.data.tokenizer.vocab_size)
        self.data.tokenizer.save(self.run_dir)
        (self.run_dir / "model_args.json").write_text(json.dumps(self.model_args.__dict__, indent=1))

        self.model = build_model(self.model_args, device="meta")
        self.model.to_empty(device=self.device)
        init_weights(self.model, t.seed, self.model_args)
        self.optimizer = build_optimizer(self.model, t)
        self.scheduler = build_lr_scheduler(self.optimizer, t)
        self.sampler = BatchSampler(self.data.train, t.seq_len, t.seed)
        self.dp_rank, self.dp_size = 0, 1
        self.step = 0
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16) if t.dtype == "bf16" else nullcontext()
        )
        self.n_params = count_params(self.model_args)
        self.log.info(
            "model %s: %s parameters (%s), data: %s train / %s val tokens (%s tokenizer, vocab %d)",
            cfg.model.flavor, f"{self.n_params:,}", _shape_str(self.model_args), f"{len(self.data.train):,}",
            f"{len(self.data.val):,}", self.data.tokenizer.kind, self.data.tokenizer.vocab_size,
        )

    # --- one optimizer step -------------------------------------------------------------
    def train_step(self) -> float:
        """Forward/backward over grad_accum micro-batches, clip, step. Returns the step's mean loss."""
        t = self.cfg.train
        inputs, targets = self.sampler.next_batch(t.batch_size, self.dp_rank, self.dp_size)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        total = torch.zeros((), device=self.device)
        # Equal-sized micro-batches, each loss scaled by 1/accum: the accumulated gradient is the
        # gradient of the mean loss over the whole batch, exactly as without accumulation.
        for x, y in zip(inputs.chunk(t.grad_accum), targets.chunk(t.grad_accum)):
            with self.autocast:
                loss = cross_entropy(self.model(x), y) / t.grad_accum
            loss.backward()
            total += loss.detach()
        if t.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip, foreach=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return float(total)

    @torch.no_grad()
    def validate(self) -> float:
        t = self.cfg.train
        self.model.eval()
        losses = []
        for x, y in val_batches(self.data.val, t.seq_len, t.batch_size, t.val_batches, self.dp_rank, self.dp_size):
            with self.autocast:
                losses.append(float(cross_entropy(self.model(x.to(self.device)), y.to(self.device))))
        self.model.train()
        return sum(losses) / len(losses)

    # --- the loop -----------------------------------------------------------------------
    def fit(self) -> TrainResult:
        t = self.cfg.train
        throughput = ThroughputModel(
            tokens_per_step=t.batch_size * t.seq_len,
            flops_per_token=flops_per_token(self.model_args, t.seq_len),
            peak_flops_total=peak_flops(self.device, t.dtype),
        )
        metrics = MetricsLogger(self.cfg.metrics, self.run_dir, t.steps, throughput, self.device, self.step)
        result = TrainResult(run_dir=self.run_dir, n_params=self.n_params)
        step_times: list[float] = []
        start = time.perf_counter()
        try:
            while self.step < t.steps:
                step_start = time.perf_counter()
                lr = self.scheduler.get_last_lr()[0]
                loss = self.train_step()
                step_times.append(time.perf_counter() - step_start)
                if not math.isfinite(loss):
                    raise FloatingPointError(f"loss became {loss} at step {self.step}; lower train.lr or use fp32")
                metrics.log_step(self.step, loss, lr, step_times[-1])
                result.losses.append(loss)
                if (t.val_every and self.step % t.val_every == 0) or self.step == t.steps:
                    val = self.validate()
                    metrics.log_val(self.step, val)
                    result.val_losses.append((self.step, val))
        finally:
            metrics.close()
        result.elapsed_s = time.perf_counter() - start
        # The first step warms up the allocator and kernels: leave it out of the throughput summary.
        timed = step_times[1:] or step_times
        result.tokens_per_s = throughput.tokens_per_step * len(timed) / sum(timed)
        result.mfu = result.tokens_per_s * throughput.flops_per_token / throughput.peak_flops_total
        save_final_model(self.model, self.model_args, self.run_dir / "final")
        return result


def _shape_str(args: Any) -> str:
    return f"dim {args.dim}, {args.n_layers} layers, {args.n_heads}/{args.n_kv_heads} heads, ffn {args.ffn_dim}, {args.mlp}"


def train(cfg: JobConfig) -> TrainResult:
    """Train one run described by ``cfg`` in this process."""
    return Trainer(cfg).fit()
