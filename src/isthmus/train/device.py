"""Which device a run uses, and its peak FLOP/s for MFU.

On CUDA the peak comes from the device's datasheet; on CPU there is no datasheet number worth
trusting, so a short matmul probe measures it once per (CPU, thread count, dtype) and caches it.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

from isthmus.errors import ConfigError
from isthmus.log import get_logger

# Dense bf16 / fp32 (non-tensor-core) peaks in FLOP/s, from the vendors' datasheets.
_CUDA_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("ISTHMUS_CACHE", Path.home() / ".cache" / "isthmus"))


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """'auto' picks CUDA when present; 'cuda' without a GPU is a user error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device", "cuda", "no CUDA device is available on this machine")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _probe_cpu_flops(dtype: torch.dtype, seconds: float = 0.3, n: int = 1024) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        iters += 1
    return 2 * n**3 * iters / (time.perf_counter() - start)


def peak_flops(device: torch.device, dtype: str = "fp32", cache_dir: Path | None = None) -> float:
    """Peak FLOP/s of one device for ``dtype`` ('fp32' or 'bf16')."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _CUDA_PEAKS.items():
            if key in name:
                return peaks[dtype]
        get_logger().warning("unknown GPU %r: MFU uses the H100 peak", name)
        return _CUDA_PEAKS["H100"][dtype]
    cache = (cache_dir or default_cache_dir()) / "cpu_peak_flops.json"
    key = f"{platform.machine()}|{platform.processor()}|{os.cpu_count()}|{torch.get_num_threads()}|{dtype}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = _probe_cpu_flops(torch.float32 if dtype == "fp32" else torch.bfloat16)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        except OSError:  # a read-only home still trains; it just probes again next time
            pass
    return float(known[key])
