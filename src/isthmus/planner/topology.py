"""The hardware a run has: device kinds, nodes, datacenters, and the WAN links between them.

A topology is a TOML file (or the name of a preset shipped in ``topologies/``)::

    name = "two-dc"
    [[datacenters]]
    name = "east"
    device = "h100-sxm"              # a kind from topologies/devices.toml, or one in [devices.*]
    nodes = 64
    devices_per_node = 8
    intra_node = { bandwidth_gb_s = 360, latency_us = 3 }   # per device, one direction
    fabric = { bandwidth_gb_s = 45, latency_us = 6 }        # per device, between nodes
    host_memory = { bandwidth_gb_s = 6, latency_us = 20 }   # optional: CPU ranks of one host, through shared memory
    [[wan]]
    between = ["east", "west"]
    bandwidth_gb_s = 50                                      # the whole link, one direction
    latency_us = 20000
    window_kib = 4096                                        # optional: largest TCP buffer of one flow

Bandwidths are achievable GB/s (10^9 bytes/s), latencies microseconds. Every problem in a file
is a :class:`ConfigError` naming the key, e.g. ``topology.datacenters[1].nodes``.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from isthmus.errors import ConfigError

DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
_DEVICE_KEYS = {
    "base",
    "description",
    "memory_gb",
    "memory_bandwidth_gb_s",
    "peak_tflops",
    "gemm_max_fraction",
    "gemm_half_dim",
    "attention_fraction",
    "memory_bw_fraction",
    "kernel_launch_us",
    "default_dtype",
    "tp_block_us",
    "sp_block_us",
    "shard_block_us",
}
ATTENTION_FRACTION = 0.56
"""A device kind's attention_fraction unless its table or base says: 0.7 of the GEMM curve at a
head_dim of 128 on the A100's curve (FlashAttention-2 on the part it was written for)."""
_DC_KEYS = {"name", "device", "nodes", "devices_per_node", "intra_node", "fabric", "host_memory"}
_LINK_KEYS = {"bandwidth_gb_s", "latency_us"}
TCP_WINDOW_SHARE = 0.5
"""The share of a socket's receive buffer Linux offers as the TCP window (``tcp_adv_win_scale = 1``:
the other half covers the kernel's per-packet overhead), as one window-bound flow in the emulator
shows (tests/geo/test_wan_latency.py; docs/benchmarks.md, WAN latency)."""
_WAN_KEYS = _LINK_KEYS | {"between", "window_kib"}


@dataclass(frozen=True)
class DeviceKind:
    """One accelerator (or CPU core) type: its peaks and how much of them real kernels reach."""

    name: str
    memory_bytes: float
    """Device memory usable by one rank."""
    memory_bandwidth: float
    """Peak memory bandwidth, bytes/s."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype (fp32, tf32, bf16, fp16, fp8)."""
    gemm_max_fraction: float
    """Fraction of peak a very large GEMM reaches (calibrated)."""
    gemm_half_dim: float
    """GEMM dimension at which that dimension alone halves the reachable fraction (saturating curve)."""
    memory_bw_fraction: float
    """Fraction of peak memory bandwidth that elementwise kernels reach."""
    kernel_launch_s: float
    """Fixed cost of one kernel (launch and tail), seconds."""
    description: str = ""
    default_dtype: str = "bf16"
    """The dtype training uses on this kind unless told otherwise (fp32 on CPUs)."""
    attention_fraction: float = ATTENTION_FRACTION
    """Fraction of the GEMM curve a fused attention kernel reaches over its (s, s) score tiles: the
    kernels are written per architecture (FlashAttention-2 reaches much more of an A100 than of an
    H100, whose own kernels need FlashAttention-3 or cuDNN)."""
    tp_block_s: float = 0.0
    """Runtime work per block and pass (forward or backward) under tensor parallelism that the ops
    above leave out: DTensor's dispatch, the collectives' copies. ``isthmus profile`` measures it
    on CPU ranks; 0 on GPUs, where it runs ahead of the kernels."""
    sp_block_s: float = 0.0
    """What sequence parallelism changes in that, per block and pass (may be negative)."""
    shard_block_s: float = 0.0
    """FSDP2's work per block and collective (its hooks, copy-in and copy-out); measured like tp_block_s."""

    def __hash__(self) -> int:  # peak_flops is a dict; the planner caches per-kind results
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(
                (
                    self.name,
                    tuple(sorted(self.peak_flops.items())),
                    self.memory_bytes,
                    self.gemm_max_fraction,
                    self.gemm_half_dim,
                    self.attention_fraction,
                    self.memory_bw_fraction,
                    self.memory_bandwidth,
                    self.kernel_launch_s,
                    self.tp_block_s,
                    self.sp_block_s,
                    self.shard_block_s,
                )
            )
            object.__setattr__(self, "_hash", cached)
        return cached

    def peak(self, dtype: str) -> float:
        """Peak FLOP/s for dtype; tf32/fp16 fall back to bf16/fp32 when the kind does not list them."""
        for name in (dtype, {"fp16": "bf16", "tf32": "fp32", "fp8": "bf16"}.get(dtype, "fp32")):
            if name in self.peak_flops:
                return self.peak_flops[name]
        raise ConfigError("train.dtype", dtype, f"device kind {self.name!r} lists no peak for it")


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: time(bytes) = latency + bytes / bandwidth."""

    bandwidth: float
    """Achievable bytes/s in one direction."""
    latency: float
    """Seconds per message."""

    window: float = math.inf
    """Largest TCP buffer of one flow, bytes (WAN links' ``window_kib``, the maximum of
    ``net.ipv4.tcp_rmem`` / ``tcp_wmem`` that ``isthmus emulate --wan-window-kib`` sets; unlimited by
    default, as a tuned datacenter's links are). Linux advertises `TCP_WINDOW_SHARE` of the receive
    buffer as the window: one flow carries at most that per round trip."""

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth

    def rate(self, flows: int = 1) -> float:
        """Bytes/s that ``flows`` TCP connections reach together: the link, or each flow's window
        per round trip (2 x latency) if that is less."""
        if math.isinf(self.window) or self.latency <= 0:
            return self.bandwidth
        return min(self.bandwidth, flows * TCP_WINDOW_SHARE * self.window / (2 * self.latency))


MAX_DEVICES_PER_DC = 1 << 20
"""Largest datacenter ``--nodes`` may build: the search enumerates divisors of the device count, which
takes seconds at this size and minutes at 10^8 (dev/LOG.md)."""


@dataclass(frozen=True)
class Datacenter:
    name: str
    kind: DeviceKind
    nodes: int
    devices_per_node: int
    intra_node: Link
    """Between devices of one node (per device)."""
    fabric: Link
    """Between nodes of this datacenter (per device: its share of the node's NICs)."""
    host_memory: Link | None = None
    """Between CPU ranks of one node through shared memory (`isthmus.parallel.shm_collectives`, measured by
    ``isthmus profile``): where the CPU runtime moves tensor parallelism's collectives; None: no such path."""

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node


@dataclass(frozen=True)
class Topology:
    name: str
    datacenters: tuple[Datacenter, ...]
    wan: dict[frozenset[str], Link] = field(default_factory=dict)
    """WAN link per unordered pair of datacenter names."""
    description: str = ""
    host_cores: int | None = None
    """Set when every device is a one-thread process on one host of this many cores (an emulated
    topology, `isthmus emulate`): up to this many compute at full speed, more share the cores.
    The simulator runs their compute on the shared cores; the closed-form cost model does not know
    which devices compute at once and leaves it out."""

    @property
    def n_devices(self) -> int:
        return sum(dc.devices for dc in self.datacenters)

    def wan_link(self, a: str, b: str) -> Link:
        return self.wan[frozenset((a, b))]

    def subset(self, n_devices: int) -> Topology:
        """The first ``n_devices`` devices in whole nodes, filling datacenters in file order."""
        if n_devices < 1 or n_devices > self.n_devices:
            raise ConfigError(
                "--gpus", n_devices, f"must be in 1..{self.n_devices} (devices in topology {self.name!r})"
            )
        kept, left = [], n_devices
        for dc in self.datacenters:
            if left <= 0:
                break
            take = min(left, dc.devices)
            if take % dc.devices_per_node and take > dc.devices_per_node:
                raise ConfigError(
                    "--gpus", n_devices, f"must fill whole nodes of {dc.devices_per_node} devices in {dc.name!r}"
                )
            if take < dc.devices_per_node:
                kept.append(replace(dc, nodes=1, devices_per_node=take))
            else:
                kept.append(replace(dc, nodes=take // dc.devices_per_node))
            left -= take
        names = {dc.name for dc in kept}
        wan = {pair: link for pair, link in self.wan.items() if pair <= names}
        return replace(self, datacenters=tuple(kept), wan=wan)

    def with_nodes(self, nodes: int) -> Topology:
        """Every datacenter with ``nodes`` nodes of its own kind and links (``--nodes``: a preset grown,
        or shrunk, past the size its file gives; the links per device stay as they are, i.e. a
        non-blocking fabric is assumed at any size)."""
        if nodes < 1:
            raise ConfigError("--nodes", nodes, "must be at least 1")
        for dc in self.datacenters:
            if nodes * dc.devices_per_node > MAX_DEVICES_PER_DC:
                raise ConfigError(
                    "--nodes",
                    nodes,
                    f"gives {nodes * dc.devices_per_node:,} devices in {dc.name!r}; at most {MAX_DEVICES_PER_DC:,} per datacenter",
                )
            # A file without a fabric describes one node; its intra-node link stands in for the fabric.
            if nodes > 1 and dc.nodes == 1 and dc.fabric is dc.intra_node:
                raise ConfigError(
                    "--nodes", nodes, f"datacenter {dc.name!r} of {self.name!r} has no fabric between nodes"
                )
        return replace(self, datacenters=tuple(replace(dc, nodes=nodes) for dc in self.datacenters))

    def with_wan(
        self, bandwidth_gb_s: float | None = None, latency_us: float | None = None, window_kib: float | None = None
    ) -> Topology:
        """A copy with every WAN link's bandwidth, latency and/or TCP window replaced (for sweeps)."""

        def change(link: Link) -> Link:
            bw = link.bandwidth if bandwidth_gb_s is None else bandwidth_gb_s * 1e9
            lat = link.latency if latency_us is None else latency_us * 1e-6
            window = link.window if window_kib is None else window_kib * 1024
            return Link(bw, lat, window)

        return replace(self, wan={pair: change(link) for pair, link in self.wan.items()})


def shipped_topologies_dir() -> Path:
    return Path(__file__).parents[1] / "topologies"


def list_presets() -> list[str]:
    """Names of the shipped topology presets (``devices.toml`` holds device kinds, not a topology)."""
    return sorted(p.stem for p in shipped_topologies_dir().glob("*.toml") if p.stem != "devices")


def device_kinds() -> dict[str, DeviceKind]:
    """The shipped device kinds (topologies/devices.toml)."""
    raw = _read_toml(shipped_topologies_dir() / "devices.toml", "topology.devices")
    kinds: dict[str, DeviceKind] = {}
    for name, table in raw.items():
        kinds[name] = _parse_device(name, table, kinds, "devices")
    return kinds


def load_topology(name_or_path: str) -> Topology:
    """A topology from a preset name (``local``, ``selene-a100``...) or a TOML file path."""
    path = Path(name_or_path)
    if not path.is_file():
        stem = name_or_path[:-5] if name_or_path.endswith(".toml") else name_or_path
        path = shipped_topologies_dir() / f"{stem}.toml"
        if stem == "devices" or not path.is_file():
            raise ConfigError(
                "--topology", name_or_path, f"no such file or preset (presets: {', '.join(list_presets())})"
            )
    return parse_topology(_read_toml(path, "--topology"), default_name=path.stem)


def _read_toml(path: Path, key: str) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(key, str(path), f"not valid TOML ({e})") from None


def parse_topology(data: dict[str, Any], default_name: str = "topology") -> Topology:
    """Build and check a Topology from parsed TOML; ConfigError names the offending key."""
    _no_unknown(data, {"name", "description", "host_cores", "devices", "datacenters", "wan"}, "topology")
    kinds = device_kinds()
    extra = data.get("devices", {})
    if not isinstance(extra, dict):
        raise ConfigError("topology.devices", extra, "must be a table of [devices.NAME] tables")
    for name, table in extra.items():
        kinds[name] = _parse_device(name, table, kinds, "topology.devices")
    dcs_raw = data.get("datacenters")
    if not isinstance(dcs_raw, list) or not dcs_raw:
        raise ConfigError("topology.datacenters", dcs_raw, "needs at least one [[datacenters]] table")
    dcs = tuple(_parse_datacenter(i, raw, kinds) for i, raw in enumerate(dcs_raw))
    names = [dc.name for dc in dcs]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"topology.datacenters[{i}].name", name, "datacenter names must be unique")
    wan = _parse_wan(data.get("wan", []), names)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if frozenset((a, b)) not in wan:
                raise ConfigError("topology.wan", f"{a}-{b}", f"missing a [[wan]] link between {a!r} and {b!r}")
    name = data.get("name", default_name)
    if not isinstance(name, str):
        raise ConfigError("topology.name", name, "must be a string")
    host_cores = _integer(data, "host_cores", "topology") if "host_cores" in data else None
    return Topology(name, dcs, wan, str(data.get("description", "")), host_cores)


def _no_unknown(table: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            raise ConfigError(f"{where}.{key}", table[key], f"unknown key; keys are: {', '.join(sorted(allowed))}")


def _finite(v: object) -> float | None:
    """A TOML number as a finite float; None for anything else (inf, nan, an integer too large for a float)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _number(table: dict[str, Any], key: str, where: str, positive: bool = True, required: bool = True) -> float | None:
    """A finite number, above 0 when ``positive`` (else 0 or more): every figure of a topology is a
    rate, a size or a time, and an infinite one breaks the arithmetic of whoever reads it."""
    if key not in table:
        if required:
            raise ConfigError(f"{where}.{key}", None, "is required")
        return None
    v = table[key]
    f = _finite(v)
    if f is None or (f <= 0 if positive else f < 0):
        raise ConfigError(
            f"{where}.{key}",
            v,
            "must be a positive finite number" if positive else "must be a finite number, 0 or more",
        )
    return f


def _integer(table: dict[str, Any], key: str, where: str) -> int:
    v = table.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}.{key}", v, "must be an integer" if key in table else "is required")
    if v < 1:
        raise ConfigError(f"{where}.{key}", v, "must be at least 1")
    if v > MAX_DEVICES_PER_DC:
        raise ConfigError(f"{where}.{key}", v, f"must be at most {MAX_DEVICES_PER_DC:,}")
    return v


def _fraction(table: dict[str, Any], key: str, where: str) -> float | None:
    v = _number(table, key, where, required=False)
    if v is not None and v > 1:
        raise ConfigError(f"{where}.{key}", v, "must be a fraction in (0, 1]")
    return v


def _parse_device(name: str, table: Any, known: dict[str, DeviceKind], where_root: str) -> DeviceKind:
    where = f"{where_root}.{name}"
    if not isinstance(table, dict):
        raise ConfigError(where, table, "must be a table")
    _no_unknown(table, _DEVICE_KEYS, where)
    base: DeviceKind | None = None
    if "base" in table:
        if table["base"] not in known:
            raise ConfigError(f"{where}.base", table["base"], f"unknown device kind; kinds are: {', '.join(known)}")
        base = known[table["base"]]
    need = base is None
    peaks = dict(base.peak_flops) if base else {}
    if "peak_tflops" in table:
        raw = table["peak_tflops"]
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(f"{where}.peak_tflops", raw, "must be a table like { bf16 = 312, fp32 = 19.5 }")
        for dt in raw:
            if dt not in DTYPES:
                raise ConfigError(
                    f"{where}.peak_tflops.{dt}", raw[dt], f"unknown dtype; dtypes are: {', '.join(DTYPES)}"
                )
            peaks[dt] = _number(raw, dt, f"{where}.peak_tflops") * 1e12  # type: ignore[operator]
    elif need:
        raise ConfigError(f"{where}.peak_tflops", None, "is required")

    def pick(key: str, scale: float, attr: str, fraction: bool = False) -> float:
        v = _fraction(table, key, where) if fraction else _number(table, key, where, required=need)
        if v is None and need and fraction:
            raise ConfigError(f"{where}.{key}", None, "is required")
        return v * scale if v is not None else getattr(base, attr)

    return DeviceKind(
        name=name,
        memory_bytes=pick("memory_gb", 1e9, "memory_bytes"),
        memory_bandwidth=pick("memory_bandwidth_gb_s", 1e9, "memory_bandwidth"),
        peak_flops=peaks,
        gemm_max_fraction=pick("gemm_max_fraction", 1.0, "gemm_max_fraction", fraction=True),
        gemm_half_dim=pick("gemm_half_dim", 1.0, "gemm_half_dim"),
        attention_fraction=_optional_fraction(
            table, "attention_fraction", where, base.attention_fraction if base else ATTENTION_FRACTION
        ),
        memory_bw_fraction=pick("memory_bw_fraction", 1.0, "memory_bw_fraction", fraction=True),
        kernel_launch_s=pick("kernel_launch_us", 1e-6, "kernel_launch_s"),
        description=str(table.get("description", base.description if base else "")),
        default_dtype=_dtype(table, where, base.default_dtype if base else "bf16"),
        tp_block_s=_overhead(table, "tp_block_us", where, base.tp_block_s if base else 0.0),
        sp_block_s=_overhead(table, "sp_block_us", where, base.sp_block_s if base else 0.0, signed=True),
        shard_block_s=_overhead(table, "shard_block_us", where, base.shard_block_s if base else 0.0),
    )


def _optional_fraction(table: dict[str, Any], key: str, where: str, default: float) -> float:
    """An optional fraction of a device kind's table; ``default`` (its base's) where absent."""
    v = _fraction(table, key, where)
    return default if v is None else v


def _overhead(table: dict[str, Any], key: str, where: str, default: float, signed: bool = False) -> float:
    """A per-block runtime overhead in microseconds (optional; 0 unless measured)."""
    if key not in table:
        return default
    v = table[key]
    f = _finite(v)
    if f is None or (f < 0 and not signed):
        raise ConfigError(f"{where}.{key}", v, "must be a number of microseconds" + ("" if signed else ", 0 or more"))
    return f * 1e-6


def _dtype(table: dict[str, Any], where: str, default: str) -> str:
    value = table.get("default_dtype", default)
    if value not in DTYPES:
        raise ConfigError(f"{where}.default_dtype", value, f"must be one of: {', '.join(DTYPES)}")
    return str(value)


def _parse_link(raw: Any, where: str) -> Link:
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "must be a table { bandwidth_gb_s = ..., latency_us = ... }")
    _no_unknown(raw, _LINK_KEYS, where)
    bw = _number(raw, "bandwidth_gb_s", where)
    lat = _number(raw, "latency_us", where, positive=False)
    return Link(bw * 1e9, lat * 1e-6)  # type: ignore[operator]


def _parse_datacenter(i: int, raw: Any, kinds: dict[str, DeviceKind]) -> Datacenter:
    where = f"topology.datacenters[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(where, raw, "must be a table")
    _no_unknown(raw, _DC_KEYS, where)
    name = raw.get("name", f"dc{i}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}.name", name, "must be a non-empty string")
    device = raw.get("device")
    if device not in kinds:
        raise ConfigError(f"{where}.device", device, f"unknown device kind; kinds are: {', '.join(kinds)}")
    nodes = _integer(raw, "nodes", where)
    per_node = _integer(raw, "devices_per_node", where)
    if nodes * per_node > MAX_DEVICES_PER_DC:
        raise ConfigError(
            f"{where}.nodes",
            nodes,
            f"gives {nodes * per_node:,} devices; at most {MAX_DEVICES_PER_DC:,} per datacenter",
        )
    intra = _parse_link(raw.get("intra_node"), f"{where}.intra_node")
    if "fabric" not in raw and nodes > 1:
        raise ConfigError(f"{where}.fabric", None, "is required when nodes > 1")
    fabric = _parse_link(raw["fabric"], f"{where}.fabric") if "fabric" in raw else intra
    host = _parse_link(raw["host_memory"], f"{where}.host_memory") if "host_memory" in raw else None
    return Datacenter(name, kinds[device], nodes, per_node, intra, fabric, host)


def _parse_wan(raw: Any, names: list[str]) -> dict[frozenset[str], Link]:
    if not isinstance(raw, list):
        raise ConfigError("topology.wan", raw, "must be a list of [[wan]] tables")
    wan: dict[frozenset[str], Link] = {}
    for i, link in enumerate(raw):
        where = f"topology.wan[{i}]"
        if not isinstance(link, dict):
            raise ConfigError(where, link, "must be a table")
        _no_unknown(link, _WAN_KEYS, where)
        pair = link.get("between")
        if not isinstance(pair, list) or len(pair) != 2 or pair[0] == pair[1]:
            raise ConfigError(f"{where}.between", pair, "must name two different datacenters")
        for end in pair:
            if end not in names:
                raise ConfigError(f"{where}.between", end, f"unknown datacenter; datacenters are: {', '.join(names)}")
        key = frozenset(pair)
        if key in wan:
            raise ConfigError(f"{where}.between", pair, "this pair already has a link")
        alpha_beta = _parse_link({k: v for k, v in link.items() if k in _LINK_KEYS}, where)
        window = _number(link, "window_kib", where, required=False)
        wan[key] = alpha_beta if window is None else replace(alpha_beta, window=window * 1024)
    return wan
