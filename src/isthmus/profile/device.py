"""Which device a run uses, and its peak FLOP/s for MFU.

On CUDA the peak comes from the device's datasheet. On CPU there is no datasheet number worth
trusting, so a matmul probe measures it: the best of several short timed runs (noise only ever
slows a run down), each counted against the CPU time the process got as well as the wall clock,
so other work sharing the cores does not read as a slow CPU. The result is cached per (machine,
torch version, thread count, dtype) in ``$ISTHMUS_CACHE/cpu_peak_flops.json`` (default
``~/.cache/isthmus``): another machine or a new torch measures again. ``isthmus profile``
measures again and rewrites this machine's entries; ``ISTHMUS_REPROBE_PEAK=1`` makes a run
measure again. A run that computes faster than the cached peak proves the peak wrong: the trainer
then calls :func:`correct_peak`, which measures once more and keeps at least the achieved rate.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout

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

PEAK_CACHE_FILE = "cpu_peak_flops.json"
REPROBE_ENV = "ISTHMUS_REPROBE_PEAK"
"""Set to 1 to measure the CPU peak again instead of reading the cache."""
PROBES = 5
PROBE_SECONDS = 0.2
PROBE_DTYPES = ("fp32", "bf16")


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


# --- the CPU probe ------------------------------------------------------------------------------


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def probe_size(threads: int) -> int:
    """Side n of the probe's n x n matmul on ``threads`` threads.

    On a CPU core the fp32 rate saturates by n = 512, and larger matrices only leave the caches
    (the sweep behind this is in dev/LOG.md). More threads split the same matmul: n grows with their
    cube root, so each thread keeps about a 512^3 share of the work (n = 640 for 2 threads, 1024 for 8).
    """
    return max(512, 128 * round(512 * threads ** (1 / 3) / 128))


def _probe_rate(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, seconds: float, cores: int) -> float:
    """FLOP/s of repeated ``a @ b`` for ``seconds``, by the wall clock or by the CPU time the
    process got, whichever is faster.

    Why the CPU time: on a shared machine the probe's threads are off their cores part of the
    time, and the wall clock would count that as a slow CPU; the matmul's rate per second on a
    core does not change. It cannot read above the machine: ``cores`` (the threads that can run
    at once) turns process CPU time back into wall time; threads spinning on a descheduled
    partner only add CPU time, so a probe can read low, never high.
    """
    n = a.shape[0]
    iters = 0
    wall, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - wall < seconds:
        torch.mm(a, b, out=out)
        iters += 1
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    flops = 2 * n**3 * iters
    return max(flops / wall, flops * cores / cpu if cpu > 0 else 0.0)


def probe_cpu_flops(
    dtype: torch.dtype, probes: int = PROBES, seconds: float = PROBE_SECONDS, n: int | None = None
) -> float:
    """Peak matmul FLOP/s of this process on its current thread count: the best of ``probes``
    timed runs of ``seconds`` each, after a warm-up (thread pool start, first-touch pages)."""
    threads = torch.get_num_threads()
    n = n or probe_size(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    cores = min(threads, usable_cores())
    _probe_rate(a, b, out, seconds / 2, cores)
    return max(_probe_rate(a, b, out, seconds, cores) for _ in range(probes))


# --- the cache ----------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "Hardware", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            return Path(path).read_text().strip()
        except OSError:
            continue
    return ""


def machine_identity() -> str:
    """This machine, as a cached peak must match it: CPU model, usable cores, and a digest of the
    hostname and machine-id (containers from one image share a machine-id; their hostnames differ)."""
    digest = hashlib.sha256(f"{socket.gethostname()}|{_machine_id()}".encode()).hexdigest()[:12]
    return f"{_cpu_model()} | {usable_cores()} cores | host {digest}"


def cpu_peak_key(dtype: str, threads: int, machine: str | None = None, torch_version: str | None = None) -> str:
    """The cache key of a CPU peak: machine, torch version (a new build may bring faster kernels),
    thread count and dtype."""
    return f"{machine or machine_identity()} | torch {torch_version or torch.__version__} | {threads} threads | {dtype}"


def _read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """The cached peaks; entries of an older format (a bare number) are dropped: they carried no
    torch version or machine, so nothing says they still hold."""
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(known, dict):
        return {}
    return {k: v for k, v in known.items() if isinstance(v, dict) and isinstance(v.get("flops"), (int, float))}


def _write_cache(path: Path, known: dict[str, dict[str, Any]]) -> None:
    """Replace the file in one step, so a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(known, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


class _CacheLock:
    """The cache file under a lock shared by every process of this machine (filelock: flock on
    POSIX), so that local ranks starting together probe one at a time instead of all at once,
    each slowing the others, and the first one's figure serves the rest."""

    def __init__(self, cache_dir: Path | None) -> None:
        self.path = (cache_dir or default_cache_dir()) / PEAK_CACHE_FILE
        self._lock: Any = None

    def __enter__(self) -> Path | None:
        """The cache file, or None when it cannot be used (a read-only home still trains)."""

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._lock = FileLock(str(self.path) + ".lock", timeout=120)
            self._lock.acquire()
        except (OSError, Timeout):
            self._lock = None
            return None
        return self.path

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()


def _torch_dtype(dtype: str) -> torch.dtype:
    return torch.float32 if dtype == "fp32" else torch.bfloat16


def _entry(flops: float, how: str) -> dict[str, Any]:
    return {
        "flops": flops,
        "how": how,
        "n": probe_size(torch.get_num_threads()),
        "measured_at": time.time(),
        "measured": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _store(path: Path | None, key: str, entry: dict[str, Any]) -> None:
    if path is None:
        return
    known = _read_cache(path)
    known[key] = entry
    try:
        _write_cache(path, known)
    except OSError:  # a full or read-only disk: the run goes on with the figure in memory
        pass


def cpu_peak_flops(dtype: str = "fp32", cache_dir: Path | None = None, remeasure: bool = False) -> float:
    """Peak FLOP/s of this process on its current thread count: cached, or probed and cached.

    ``remeasure`` (or ``ISTHMUS_REPROBE_PEAK=1``) probes even when the cache has the key, unless
    another process (a local rank started with this one) probed it after this call began.
    """
    asked_at = time.time()
    remeasure = remeasure or os.environ.get(REPROBE_ENV, "") not in ("", "0")
    key = cpu_peak_key(dtype, torch.get_num_threads())
    with _CacheLock(cache_dir) as path:
        cached = _read_cache(path).get(key) if path is not None else None
        if cached is not None and (not remeasure or cached.get("measured_at", 0) >= asked_at):
            return float(cached["flops"])
        flops = probe_cpu_flops(_torch_dtype(dtype))
        _store(path, key, _entry(flops, "probe"))
    get_logger().info(
        "CPU peak %.1f GFLOP/s (%s, %d thread(s), best of %d x %.1f s matmul probes)%s",
        flops / 1e9,
        dtype,
        torch.get_num_threads(),
        PROBES,
        PROBE_SECONDS,
        f"; cached in {path}" if path is not None else "",
    )
    return flops


def remeasure_cpu_peaks(threads: list[int], cache_dir: Path | None = None) -> dict[tuple[int, str], float]:
    """Probe every dtype at each thread count and rewrite this machine's cache entries with the
    results (``isthmus profile``): entries of this machine under other thread counts or another
    torch go, those of other machines sharing the cache directory stay."""
    old = torch.get_num_threads()
    machine = machine_identity()
    peaks = {}
    with _CacheLock(cache_dir) as path:
        try:
            for t in threads:
                torch.set_num_threads(t)
                for dtype in PROBE_DTYPES:
                    peaks[t, dtype] = probe_cpu_flops(_torch_dtype(dtype))
        finally:
            torch.set_num_threads(old)
        if path is not None:
            known = {k: v for k, v in _read_cache(path).items() if not k.startswith(machine + " |")}
            for (t, dtype), flops in peaks.items():
                known[cpu_peak_key(dtype, t, machine)] = {**_entry(flops, "isthmus profile"), "n": probe_size(t)}
            try:
                _write_cache(path, known)
            except OSError:
                pass
    return peaks


def peak_flops(
    device: torch.device, dtype: str = "fp32", cache_dir: Path | None = None, remeasure: bool = False
) -> float:
    """Peak FLOP/s of one device for ``dtype`` ('fp32' or 'bf16')."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in _CUDA_PEAKS.items():
            if key in name:
                return peaks[dtype]
        get_logger().warning("unknown GPU %r: MFU uses the H100 peak", name)
        return _CUDA_PEAKS["H100"][dtype]
    return cpu_peak_flops(dtype, cache_dir, remeasure)


def describe_peak(device: torch.device, dtype: str = "fp32", cache_dir: Path | None = None) -> str:
    """Where the peak that MFU divides by comes from, in a few words: the datasheet on a GPU, the
    probe's size, threads, best-of and date on a CPU (from the cache entry this run used)."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} datasheet, dense {dtype}"
    threads = torch.get_num_threads()
    path = (cache_dir or default_cache_dir()) / PEAK_CACHE_FILE
    entry = _read_cache(path).get(cpu_peak_key(dtype, threads), {})
    n = entry.get("n", probe_size(threads))
    how = entry.get("how", "probe")
    when = f" {entry['measured'][:16]}" if "measured" in entry else ""
    return f"{dtype} {n}x{n} matmul, {threads} thread(s), best of {PROBES} x {PROBE_SECONDS} s ({how}{when})"


def correct_peak(
    device: torch.device, dtype: str, peak: float, achieved: float, first: bool, cache_dir: Path | None = None
) -> float:
    """The peak after one device computed at ``achieved`` FLOP/s, above the ``peak`` believed so far.

    That peak was wrong (on CPU: probed while other work held the cores). The first time, the CPU
    is probed again and one warning line says so; the new peak is never below the achieved rate,
    and it replaces the cached one. On a GPU the datasheet figure stands corrected to the rate.
    """
    log = get_logger()
    new = achieved
    if device.type == "cpu":
        key = cpu_peak_key(dtype, torch.get_num_threads())
        with _CacheLock(cache_dir) as path:
            if first:
                new = max(achieved, probe_cpu_flops(_torch_dtype(dtype)))
            _store(path, key, _entry(new, "probe" if new > achieved else "achieved by a training step"))
    if first:
        log.warning(
            "a step ran at %.1f GFLOP/s per device, above the peak %.1f GFLOP/s that MFU used (measured "
            "under load?): the peak is now %.1f GFLOP/s%s",
            achieved / 1e9,
            peak / 1e9,
            new / 1e9,
            " (probed again and cached)" if device.type == "cpu" else "",
        )
    else:
        log.debug("peak raised to the achieved %.1f GFLOP/s", new / 1e9)
    return new


def devices_worth(world: int, local_world: int, threads: int, device: torch.device) -> float:
    """How many devices' worth of compute ``world`` ranks have, ``local_world`` of them per machine.

    A CPU rank's peak is probed with its ``threads`` (at most the cores); local ranks that together
    ask for more cores than the machine has share them, and MFU counts the machine's cores once.
    """
    if device.type != "cpu":
        return float(world)
    cores = usable_cores()
    wanted = local_world * min(threads, cores)
    return world * min(1.0, cores / wanted)


@dataclass(frozen=True)
class RankPeak:
    """What one CPU rank brings to a job's peak: its host, its probed peak, its threads and the
    cores it may run on there."""

    host: str
    peak_flops: float
    threads: int
    cores: int


def this_rank_peak(peak: float) -> RankPeak:
    """This process's :class:`RankPeak` (``peak``: what it probed, :func:`peak_flops`)."""
    return RankPeak(socket.gethostname(), peak, torch.get_num_threads(), usable_cores())


def host_peaks(ranks: list[RankPeak]) -> dict[str, float]:
    """Peak FLOP/s of each host of a CPU job: its cores counted once, shared by the ranks there (as
    :func:`devices_worth` does for one machine), at the peak each of its ranks probed."""
    by_host: dict[str, list[RankPeak]] = {}
    for r in ranks:
        by_host.setdefault(r.host, []).append(r)
    peaks = {}
    for host, on_host in sorted(by_host.items()):
        cores = max(r.cores for r in on_host)
        share = min(1.0, cores / sum(min(r.threads, cores) for r in on_host))
        peaks[host] = sum(share * r.peak_flops for r in on_host)
    return peaks


def job_devices(ranks: list[RankPeak], reference_peak: float) -> float:
    """Devices' worth of compute of a CPU job whose ranks run on several hosts, in units of
    ``reference_peak`` (rank 0's peak, which MFU divides by): the hosts need not be alike."""
    return sum(host_peaks(ranks).values()) / reference_peak if reference_peak > 0 else 0.0


def describe_hosts(ranks: list[RankPeak]) -> str:
    """``host0 2 rank(s) on 1 core(s), 30.1 GFLOP/s; host1 ...``: each host's share of the peak."""
    counts = {host: [r for r in ranks if r.host == host] for host in {r.host for r in ranks}}
    return "; ".join(
        f"{host} {len(counts[host])} rank(s) on {max(r.cores for r in counts[host])} core(s), {flops / 1e9:.1f} GFLOP/s"
        for host, flops in host_peaks(ranks).items()
    )
