"""Tensor parallelism's collectives through shared memory for the ranks of one process group that
share a host (CPU, gloo): the all-reduce, and sequence parallelism's all-gather and reduce-scatter.

Why by hand: gloo, torch's CPU backend, moves every collective over TCP, loopback included, and has
no shared-memory transport; oneCCL's (torch-ccl) is a separate Intel build, and DeepSpeed carries its
own C++ shared-memory all-reduce for CPU ranks for the same reason. Tensor parallelism puts two
blocking collectives of one activation into every block, forward and backward, on the critical path,
where gloo pays loopback TCP and its wake-ups and a copy through shared memory does not
(benchmarks/tp_collectives.py; its figures in docs/benchmarks.md).

How: one shared file in /dev/shm, mapped by every rank of the group and unlinked as soon as all have
it (a crash leaves nothing behind), holds a sequence counter per rank and two banks of one slot per
rank. A call copies this rank's tensor into its slot of bank ``seq % 2``, publishes ``seq``, waits
until every rank has published ``seq``, then reads what it needs: the all-reduce sums every slot in
rank order, the reduce-scatter sums this rank's chunk of every slot in rank order, the all-gather
concatenates the slots. Every rank adds the same numbers in the same order, so all hold the same
bits (for two ranks, the same bits as gloo's sum, since a + b == b + a). Two banks make one wait per
call enough: a rank writes bank ``seq % 2`` only after every rank published ``seq - 1``, which each
does only after it has read bank ``(seq - 2) % 2``.

The ordering argument needs stores made visible in program order (the data before the counter),
which x86-64 guarantees and weaker memory models (ARM) do not without a fence Python cannot issue,
so other machines keep the backend's collectives. So do groups that span hosts, non-gloo groups,
non-CPU tensors, and a /dev/shm without room for the buffer (the space is reserved up front, so a
full tmpfs is an error here, not a SIGBUS later). Compiled blocks trace the backend's collectives
into their graphs instead.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import socket
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from isthmus.errors import RunFailed

log = logging.getLogger("isthmus")

SHM_DIR = Path("/dev/shm")
_LINE = 64  # one cache line per rank's counter, so counters written by different ranks never share one
_MIN_SLOT = 1 << 20
_MAX_SLOT = 256 << 20  # larger tensors go through the backend rather than hold this much /dev/shm
_SPIN_S = 2e-4  # wait by yielding this long, then by sleeping (ranks may outnumber cores)


class BackendCollectives:
    """The collectives tensor and sequence parallelism need over one group, through its backend.
    ``dim`` is the dimension gathered along or scattered over (the sequence, under sequence parallelism)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world = dist.get_world_size(group)

    def all_reduce(self, t: Tensor) -> None:
        """Sum ``t`` over the group in place."""
        dist.all_reduce(t, group=self.group)

    def all_gather(self, t: Tensor, dim: int) -> Tensor:
        """Every rank's ``t`` concatenated along ``dim`` in rank order (a new tensor)."""
        return _waited(funcol.all_gather_tensor(t.contiguous(), dim, self.group))

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        """This rank's chunk along ``dim`` of the sum of every rank's ``t`` (a new tensor; the group's
        size divides ``t.shape[dim]``)."""
        return _waited(funcol.reduce_scatter_single(t.contiguous(), "sum", dim, self.group))


def _waited(t: Tensor) -> Tensor:
    """The plain tensor of a functional collective's result (eager mode hands back a wrapper that
    waits on first use; compiled code gets the wait in its graph)."""
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def build_collectives(group: dist.ProcessGroup, timeout_s: float) -> BackendCollectives:
    """The group's collectives: through shared memory where its ranks share this host (CPU tensors,
    gloo, x86-64), else the backend's. Collective: every rank of ``group`` calls it."""
    if dist.get_backend(group) != "gloo" or platform.machine().lower() not in ("x86_64", "amd64"):
        return BackendCollectives(group)
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, _host_id(), group=group)
    if len(set(hosts)) != 1 or len(hosts) == 1:
        return BackendCollectives(group)
    return SharedMemoryCollectives(group, timeout_s)


def _host_id() -> str:
    """Hostname, boot and the /dev/shm file system: ranks that agree on all three share its files.

    The file system's device number tells apart containers of one machine that share a hostname and
    the kernel's boot but each have a /dev/shm of their own (a file one creates, the other cannot
    open); network namespaces share it, and so do the ranks of one host.
    """
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    try:
        shm = str(SHM_DIR.stat().st_dev)
    except OSError:
        shm = ""
    return f"{socket.gethostname()}/{boot}/{shm}"


def _rank_order_sum(parts: list[Tensor], out: Tensor) -> Tensor:
    """``parts[0] + parts[1] + ...`` into ``out``, in rank order: every rank adds the same numbers in the
    same order, so all hold the same bits. ``out`` may be this rank's own tensor: the slots hold copies."""
    torch.add(parts[0], parts[1], out=out)
    for part in parts[2:]:
        out.add_(part)
    return out


class SharedMemoryCollectives(BackendCollectives):
    """The shared-memory collectives over one group's ranks (see the module docstring); what shared
    memory cannot serve goes through the backend, on every rank alike."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float) -> None:
        super().__init__(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self.seq = 0
        self.slot_bytes = 0
        self.usable = True
        self._map: mmap.mmap | None = None
        self._counters = torch.empty(0, dtype=torch.int64)
        self._banks = torch.empty(0, dtype=torch.uint8)

    def all_reduce(self, t: Tensor) -> None:
        if not t.is_contiguous() or not self._serves(t):
            super().all_reduce(t)
            return
        _rank_order_sum(self._exchange(t), out=t)

    def all_gather(self, t: Tensor, dim: int) -> Tensor:
        if not self._serves(t):
            return super().all_gather(t, dim)
        return torch.cat(self._exchange(t), dim=dim)

    def reduce_scatter(self, t: Tensor, dim: int) -> Tensor:
        if not self._serves(t):
            return super().reduce_scatter(t, dim)
        chunk = t.shape[dim] // self.world
        parts = [part.narrow(dim, self.rank * chunk, chunk) for part in self._exchange(t)]
        return _rank_order_sum(parts, out=torch.empty(parts[0].shape, dtype=t.dtype))

    def _serves(self, t: Tensor) -> bool:
        """Whether shared memory takes ``t``. Every rank passes the same shapes in the same order, so
        every rank answers alike. Inside a compiled block the backend's collective is traced into the
        graph (dynamo cannot trace the shared file and the waiting loop); every rank compiles the same."""
        if torch.compiler.is_compiling() or not t.is_cpu:
            return False
        nbytes = t.numel() * t.element_size()
        return nbytes <= _MAX_SLOT and self._fits(nbytes)

    def _exchange(self, t: Tensor) -> list[Tensor]:
        """Publish ``t`` in this rank's slot and wait for every rank's: the slots as tensors shaped like
        ``t``, in rank order, valid until this rank's next call."""
        self.seq += 1
        bank = self._banks[self.seq % 2]
        nbytes = t.numel() * t.element_size()
        bank[self.rank, :nbytes].view(t.dtype).view(t.shape).copy_(t)
        self._counters[self.rank] = self.seq
        self._wait_all(self.seq)
        return [bank[r, :nbytes].view(t.dtype).view(t.shape) for r in range(self.world)]

    def _wait_all(self, seq: int) -> None:
        start = time.monotonic()
        pause = 0.0
        while int(self._counters.min()) < seq:
            waited = time.monotonic() - start
            if waited > self.timeout_s:
                late = [r for r in range(self.world) if int(self._counters[r]) < seq]
                raise RunFailed(
                    f"tensor-parallel collective: rank(s) {late} of the group did not arrive within "
                    f"parallel.timeout_s = {self.timeout_s:g} s"
                )
            if waited < _SPIN_S:
                os.sched_yield()
            else:
                pause = min(1e-3, max(2e-5, pause * 2))
                time.sleep(pause)

    def _fits(self, nbytes: int) -> bool:
        """Make the slots at least ``nbytes`` long (collective: a new shared file) and say whether
        shared memory can serve; False once /dev/shm had no room, on every rank alike."""
        if nbytes <= self.slot_bytes:
            return True
        if not self.usable:
            return False
        slot = max(_MIN_SLOT, 1 << (nbytes - 1).bit_length())
        mapped = self._map_shared(slot)
        if mapped is None:
            self.usable = False
            return False
        # The old map is not closed by hand: the old views hold it (torch.frombuffer), and it is
        # unmapped when the last of them goes.
        self._map, self.slot_bytes, self.seq = mapped, slot, 0
        raw = torch.frombuffer(mapped, dtype=torch.uint8)
        head = _LINE * self.world
        self._counters = raw[:head].view(torch.int64)[:: _LINE // 8]
        self._banks = raw[head:].view(2, self.world, slot)
        return True

    def _map_shared(self, slot: int) -> mmap.mmap | None:
        """Rank 0 creates and reserves the file, every rank maps it, rank 0 unlinks it; None (on every
        rank) when rank 0 could not reserve it."""
        size = _LINE * self.world + 2 * self.world * slot
        path: list[str | None] = [None]
        if self.rank == 0:
            path[0] = self._create(size)
        dist.broadcast_object_list(path, group_src=0, group=self.group)
        if path[0] is None:
            return None
        fd = os.open(path[0], os.O_RDWR)
        try:
            mapped = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        dist.barrier(group=self.group)
        if self.rank == 0:
            os.unlink(path[0])
        return mapped

    @staticmethod
    def _create(size: int) -> str | None:
        """A new file of ``size`` zero bytes (so every counter starts at 0) in /dev/shm, its space
        reserved; None, logged, when there is no room."""
        path = SHM_DIR / f"isthmus-allreduce-{uuid.uuid4().hex}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("tensor-parallel collectives go through gloo: no room in %s (%s)", SHM_DIR, e)
            path.unlink(missing_ok=True)
            return None
        return str(path)
