"""Training metrics in one place: progress bar, console lines, JSON lines, TensorBoard.

Only the rank chosen by the trainer (rank 0) creates a :class:`MetricsLogger` that writes; the
cross-rank loss reduction happens in the trainer and only on steps that are logged.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from isthmus.config import MetricsConfig
from isthmus.errors import full_disk_as
from isthmus.log import get_logger


def _open_records(path: Path, start_step: int) -> Any:
    """A fresh file, or for a resumed run the old records up to ``start_step`` and then append.

    Records past ``start_step`` were written after the checkpoint the run resumed from (by a run
    that then died): they are dropped, so every step appears once.
    """
    if start_step > 0 and path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= start_step:
                    kept.append(line)
            except (ValueError, KeyError):  # a line cut short by a crash
                continue
        path.write_text("".join(line + "\n" for line in kept))
        return path.open("a")
    return path.open("w")


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak, or the resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


@dataclass
class ThroughputModel:
    """What turns a step time into tokens/s and MFU."""

    tokens_per_step: int
    flops_per_token: int
    peak_flops: float
    """Peak FLOP/s of one device (isthmus.profile.device.peak_flops)."""
    devices: float = 1.0
    """Devices' worth of compute in the run: the ranks, fewer when local ranks share cores."""
    correct_peak: Callable[[float, float, bool], float] | None = None
    """(peak, achieved FLOP/s per device, first time?) -> the corrected peak, called when a step
    beats the peak (isthmus.profile.device.correct_peak); None: MFU is only capped at 1."""
    corrections: int = 0

    def flops_per_device(self, tokens_per_s: float) -> float:
        """Model FLOP/s of one device at ``tokens_per_s`` (the whole run's rate)."""
        return tokens_per_s * self.flops_per_token / self.devices if self.devices > 0 else 0.0

    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation at ``tokens_per_s``, never above 1.

        A rate above the peak proves the peak wrong (a CPU probe taken under load), not the
        model's FLOP count: the peak is corrected first (once re-measured, then raised to any
        faster rate), and what is shown is capped at 100% even without a correction.
        """
        if self.peak_flops <= 0 or self.devices <= 0:
            return 0.0
        achieved = self.flops_per_device(tokens_per_s)
        if achieved > self.peak_flops and self.correct_peak is not None:
            self.peak_flops = max(achieved, self.correct_peak(self.peak_flops, achieved, self.corrections == 0))
            self.corrections += 1
        return min(1.0, achieved / self.peak_flops)


def expert_line(record: dict[str, Any]) -> str:
    """A MoE step's one console line: the least and most loaded expert (1.00 = an even share), then the
    aux loss and dropped tokens where they apply."""
    parts = [f"experts: load {record['expert_load_min']:.2f}-{record['expert_load_max']:.2f} x even"]
    if "moe_aux_loss" in record:
        parts.append(f"aux loss {record['moe_aux_loss']:.3f}")
    if "tokens_dropped" in record:
        parts.append(f"dropped {100 * record['tokens_dropped']:.1f}%")
    return "  ".join(parts)


class MetricsLogger:
    """Writes every step's record; shows a progress bar on a terminal and a line every log_every steps."""

    def __init__(
        self,
        cfg: MetricsConfig,
        run_dir: Path,
        total_steps: int,
        throughput: ThroughputModel,
        device: torch.device,
        start_step: int = 0,
    ) -> None:
        self.cfg, self.throughput, self.device = cfg, throughput, device
        self.total_steps = total_steps
        self.start_time = time.perf_counter()
        path = Path(cfg.jsonl) if cfg.jsonl else run_dir / "metrics.jsonl"
        self.path = path
        with full_disk_as("metrics", path, "metrics.jsonl"):
            path.parent.mkdir(parents=True, exist_ok=True)
            self._jsonl = _open_records(path, start_step)
        self._tb = self._open_tensorboard(run_dir) if cfg.tensorboard else None
        self._progress = None
        self._task = None
        if cfg.progress and sys.stdout.isatty():  # where rich draws it
            self._progress = Progress(
                TextColumn("step {task.completed}/{task.total}"),
                BarColumn(),
                TextColumn("loss {task.fields[loss]:.4f}  {task.fields[tps]:,.0f} tok/s"),
                TimeRemainingColumn(),
                transient=False,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, loss=float("nan"), tps=0.0
            )
            self._progress.start()

    @staticmethod
    def _open_tensorboard(run_dir: Path) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            get_logger().warning(
                "metrics.tensorboard = true but tensorboard is not installed (pip install -c constraints.txt -e '.[tensorboard]')"
            )
            return None
        return SummaryWriter(str(run_dir / "tb"))

    def _write(self, record: dict[str, Any]) -> None:
        with full_disk_as("metrics", self.path, "metrics.jsonl"):
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def log_step(
        self, step: int, loss: float, lr: float, step_time_s: float, extra: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Record optimizer step ``step`` (1-based) that took ``step_time_s``."""
        tp = self.throughput
        tokens_per_s = tp.tokens_per_step / step_time_s if step_time_s > 0 else 0.0
        mfu = tp.mfu(tokens_per_s)
        record = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_mem_gb": peak_memory_gb(self.device),
            "step_time_s": step_time_s,
            "elapsed_s": time.perf_counter() - self.start_time,
            **(extra or {}),
        }
        self._write(record)
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, loss=loss, tps=tokens_per_s)
        if step % self.cfg.log_every == 0 or step == self.total_steps:
            get_logger().info(
                "step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  mfu %.1f%%  mem %.2f GB",
                step,
                self.total_steps,
                loss,
                lr,
                tokens_per_s,
                100 * mfu,
                record["peak_mem_gb"],
            )
            if "expert_load_max" in record:
                get_logger().info("  %s", expert_line(record))
        return record

    def log_val(self, step: int, val_loss: float) -> dict[str, Any]:
        record = {"step": step, "val_loss": val_loss, "elapsed_s": time.perf_counter() - self.start_time}
        self._write(record)
        get_logger().info("step %d  val_loss %.4f", step, val_loss)
        return record

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        try:
            self._jsonl.close()
        except OSError:
            pass  # every record was flushed when written; what a failed write left buffered is reported by it
        if self._tb is not None:
            self._tb.close()
