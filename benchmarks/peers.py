"""The benchmark of record: isthmus against hand-written torch and Colossal-AI 0.5.0, mode by mode.

One shape (torchtitan's debug model, isthmus's `debug` flavor: Llama, dim 256, 6 layers, 16 heads,
SwiGLU 768, vocab 2048, untied, fp32), AdamW, gradient clipping at 1.0, 8 sequences x 256 tokens per
rank (DP/ZeRO: a global batch of 16; TP/PP/CP: the two ranks share one batch of 8), 2 gloo ranks of
one thread each, the same seed and the same batches (uniform random token ids from a seeded
generator: a step's throughput does not depend on what the ids mean).

- isthmus: its real `Trainer`, built as `isthmus train` builds it with the mode's --parallel.* flags.
- torch: the textbook loop on the same model (`build_model` + `init_weights`): DistributedDataParallel;
  ZeRO-1 = DDP + ZeroRedundancyOptimizer; ZeRO-2/3 = fully_shard with reshard_after_forward
  False/True; TP = parallelize_module with Colwise/Rowwise plans (+ SequenceParallel norms);
  PP = PipelineStage + Schedule1F1B; CP = torch's experimental context_parallel.
- Colossal-AI 0.5.0 (benchmarks/peers_colossal.py, in a venv of its own this script creates).

With --compile, isthmus runs with --train.compile true and the torch loop compiles its blocks and
loss the same way (torch.compile per block, after the TP plans, before FSDP/DDP/the pipeline split;
under TP the loss stays eager, as loss_parallel needs); Colossal-AI's plugins have no compile
option and run eager.

The systems take turns block by block: in each round, for each mode, isthmus and torch (one process
pair, order swapped every round) and then Colossal-AI (its own process pair), so that machine noise
falls on all of them alike. Printed per mode: each system's tokens/s (median over rounds), the
per-round ratios isthmus / peer and their median (> 1: isthmus is faster).

With ddp among the modes, a third table gives the bound of any DDP of this model here: isthmus's own
DDP step under DDP's ``no_sync`` (both ranks compute as before, no gradient is summed), timed in the
same turn as isthmus and torch. Colossal-AI's TorchDDPPlugin wraps the same model in the same torch
DDP, so no DDP can be faster than Colossal-AI's by more than bound / Colossal-AI.

    python benchmarks/peers.py [--modes ddp,zero1,...] [--rounds 3] [--steps 5] [--warmup 2] [--compile] [--out FILE]
                               [--plot docs/img/peers.svg]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import peers_common as pc  # noqa: E402
from isthmus.parallel.rendezvous import LOOPBACK, loopback_store_server, served_store_environ  # noqa: E402
from isthmus.train.short_run import capped, max_steps_override  # noqa: E402

SYSTEMS = ("isthmus", "torch", "colossalai")
UNSYNCED = "isthmus-unsynced"  # isthmus's DDP step with no gradient all-reduce: the DDP bound
COLOSSAL_VENV = Path.home() / ".cache" / "isthmus" / "bench" / "colossalai-venv"
# Colossal-AI 0.5.0's requirements/requirements.txt without its torch pin (it asks for torch<=2.5.1;
# we keep the project's 2.13.0 and install colossalai itself with --no-deps).
COLOSSAL_REQUIREMENTS = (
    "numpy tqdm psutil packaging pre-commit rich click fabric contexttimer ninja safetensors einops pydantic "
    "ray sentencepiece google protobuf transformers==4.51.3 peft>=0.7.1,<=0.13.2 bitsandbytes>=0.39.0 rpyc==6.0.0 "
    "fastapi uvicorn==0.29.0 galore_torch diffusers==0.29.0"
).split()


# ---- the project venv's worker: isthmus and hand-written torch -------------------------------------


def isthmus_trainer(mode: str, root: str, compile_blocks: bool) -> object:
    """The real trainer, built exactly as `isthmus train` builds it from these flags."""
    from isthmus.config import build_config, parse_overrides
    from isthmus.train.trainer import Trainer

    args = [
        *("--model.flavor", "debug", "--data.path", f"{root}/tokens.bin"),
        *("--train.batch_size", str(pc.global_batch(mode)), "--train.seq_len", str(pc.SEQ_LEN)),
        *("--train.seed", str(pc.SEED), "--train.lr", str(pc.LR), "--train.grad_clip", str(pc.GRAD_CLIP)),
        *("--train.steps", "100000", "--train.threads", "1", "--train.val_every", "0"),
        *("--metrics.progress", "false", "--train.run_dir", f"{root}/run-{mode}", "--parallel.nproc", "2"),
        *pc.MODES[mode],
        *(("--train.compile", "true") if compile_blocks else ()),
    ]
    return Trainer(build_config(None, parse_overrides(args)))


def plain_model(trainer: object) -> torch.nn.Module:
    from isthmus.models.llama import build_model, init_weights

    a = trainer.model_args  # type: ignore[attr-defined]
    model = build_model(a, device="cpu")
    init_weights(model, pc.SEED, a)
    return model


def plain_tp_plan(sequence_parallel: bool) -> tuple[dict, dict]:
    """torchtitan's textbook Llama plan: columns in, rows out, a vocabulary-parallel head for loss_parallel."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    between = Shard(1) if sequence_parallel else Replicate()
    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "output": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    block = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        top["norm"] = SequenceParallel()
        block.update(
            attention_norm=SequenceParallel(),
            ffn_norm=SequenceParallel(),
            # The block passes (x, cos, sin): gather x's sequence for attention, leave the rotary tables.
            attention=PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            feed_forward=PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        )
    return top, block


def clip_mixed(params: list[torch.nn.Parameter]) -> None:
    """clip_grad_norm_ by hand for TP without SP: the norms' weights stay plain tensors there, and torch's
    clip_grad_norm_ refuses a mix of tensors and DTensors (its foreach norm and multiply take one kind)."""
    from torch.distributed.tensor import DTensor

    norms = [torch.linalg.vector_norm(p.grad) for p in params if p.grad is not None]
    total = torch.stack([n.full_tensor() if isinstance(n, DTensor) else n for n in norms]).norm()
    coef = min(1.0, pc.GRAD_CLIP / (float(total) + 1e-6))
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef)


def torch_step(mode: str, trainer: object, compile_blocks: bool) -> pc.Step:
    """The hand-written torch loop of ``mode`` on isthmus's model, init and batch order; with
    ``compile_blocks`` its blocks and loss go through torch.compile as torchtitan's do."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from isthmus.data.loader import BatchSampler

    sampler = BatchSampler(trainer.data.train, pc.SEQ_LEN, pc.SEED)  # type: ignore[attr-defined]
    rank, batch = dist.get_rank(), pc.global_batch(mode)
    model = plain_model(trainer)
    mesh = init_device_mesh("cpu", (pc.WORLD,))

    def adamw(params: object) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=pc.LR, betas=(0.9, 0.95), weight_decay=0.1)

    def ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))

    if compile_blocks and mode not in ("tp", "tp_sp"):  # loss_parallel's DTensor loss runs eager
        ce = torch.compile(ce)  # type: ignore[assignment]

    def own_input(_: torch.nn.Module, args: tuple) -> tuple:
        # TP's embedding hands the first block a view of a DTensor's local shard, which a compiled
        # block's backward cannot route (torch 2.13): the same copy isthmus makes.
        return (args[0].clone(), *args[1:]) if args[0]._base is not None else args

    def compile_layers() -> None:
        if compile_blocks:
            for name, block in list(model.layers.items()):
                model.layers[name] = torch.compile(block)
                model.layers[name].register_forward_pre_hook(own_input)

    if mode in pc.DATA_PARALLEL:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        compile_layers()
        if mode in ("zero2", "zero3"):
            reshard = mode == "zero3"  # ZeRO-2 keeps the gathered parameters from forward to backward
            for block in model.layers.values():
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        else:
            model = DistributedDataParallel(model)
        opt = (
            ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.AdamW, lr=pc.LR, betas=(0.9, 0.95), weight_decay=0.1
            )
            if mode == "zero1"
            else adamw(model.parameters())
        )

        def step() -> float:
            x, y = sampler.next_batch(batch, rank, pc.WORLD)
            loss = ce(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), pc.GRAD_CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(loss := loss.detach())  # the mean over ranks, as isthmus reports it
            return float(loss) / pc.WORLD

        return step
    if mode in ("tp", "tp_sp"):
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        top, block_plan = plain_tp_plan(mode == "tp_sp")
        parallelize_module(model, mesh, top)
        for block in model.layers.values():
            parallelize_module(block, mesh, block_plan)
        compile_layers()
        opt = adamw(model.parameters())

        def step() -> float:
            x, y = sampler.next_batch(batch, 0, 1)  # both ranks compute on the whole batch
            with loss_parallel():
                loss = ce(model(x), y)
                loss.backward()
            clip_mixed(list(model.parameters()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.full_tensor())

        return step
    if mode == "pp":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        half = len(model.layers) // 2
        for i in list(model.layers):
            if (int(i) < half) != (rank == 0):
                del model.layers[i]
        if rank == 0:
            model.norm, model.output = None, None
        else:
            model.tok_embeddings = None
        compile_layers()
        stage = PipelineStage(model, rank, pc.WORLD, torch.device("cpu"))
        schedule = Schedule1F1B(stage, n_microbatches=pc.MICROBATCHES, loss_fn=ce)
        opt = adamw(model.parameters())
        params = list(model.parameters())

        def step() -> float | None:
            x, y = sampler.next_batch(batch, 0, 1)
            losses: list[torch.Tensor] = []
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=losses)
            # Each stage holds half the gradients: the clipping norm sums the squares of both.
            sq = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
            dist.all_reduce(sq)
            torch.nn.utils.clip_grads_with_norm_(params, pc.GRAD_CLIP, sq.sqrt())
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(torch.stack(losses).mean()) if losses else None  # the last stage's

        return step
    assert mode == "cp", mode
    from torch.distributed.tensor.experimental import context_parallel

    opt = adamw(model.parameters())

    def step() -> float:
        x, y = sampler.next_batch(batch, 0, 1)
        # Positions travel as a buffer so that rotary embeddings see each shard's true positions.
        positions = torch.arange(pc.SEQ_LEN)
        with context_parallel(mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 0]):
            loss = ce(model(x, positions=positions), y)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), pc.GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    return step


def isthmus_step(trainer: object) -> pc.Step:
    def step() -> float:
        return trainer.train_step()[0].loss  # type: ignore[attr-defined]

    return step


def unsynced_step(trainer: object) -> pc.Step:
    """The trainer's DDP step with DDP's gradient all-reduce switched off (``no_sync``): the replicas
    drift apart, which changes nothing in a step's time."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = next(m for m in trainer.pm.modules if isinstance(m, DistributedDataParallel))  # type: ignore[attr-defined]

    def step() -> float:
        with ddp.no_sync():
            return trainer.train_step()[0].loss  # type: ignore[attr-defined]

    return step


def project_worker(rank: int, opts: argparse.Namespace) -> None:
    """One rank of the project venv's pair: build every mode's two systems, then time them turn by turn."""
    import torch.distributed as dist

    pc.init_gloo(rank)
    steps: dict[tuple[str, str], pc.Step] = {}
    na: dict[str, str] = {}
    first_loss: dict[str, float] = {}
    for mode in opts.modes:
        trainer = isthmus_trainer(mode, opts.root, bool(opts.compile))
        builds = [
            ("isthmus", lambda: isthmus_step(trainer)),
            ("torch", lambda: torch_step(mode, trainer, bool(opts.compile))),
        ]
        if mode == "ddp":
            builds.append((UNSYNCED, lambda: unsynced_step(trainer)))
        for system, build in builds:
            key = f"{system}/{mode}"
            if (step := pc.probe(key, build, first_loss, na)) is not None:
                steps[system, mode] = step
    pc.report_ready(opts.root, "project", na, first_loss)
    for r in range(opts.rounds):
        for mode in opts.modes:
            pc.wait_turn(opts.root, "project", r, mode)
            order = ("isthmus", "torch", UNSYNCED) if r % 2 == 0 else (UNSYNCED, "torch", "isthmus")
            seconds = {s: pc.time_block(steps[s, mode], opts.warmup, opts.steps) for s in order if (s, mode) in steps}
            if rank == 0:
                pc.finish_turn(opts.root, "project", r, mode, seconds)
    dist.barrier()
    dist.destroy_process_group()


# ---- Colossal-AI's venv --------------------------------------------------------------------------


def colossal_python(log: Path) -> tuple[str | None, str]:
    """The Colossal-AI venv's python (created on first use: a few minutes, network needed), or None and why."""
    py = COLOSSAL_VENV / "bin" / "python"
    stamp = COLOSSAL_VENV / ".isthmus-complete"
    if stamp.exists():
        return str(py), "reused"
    # torch 2.13.0 comes from the same place as the project's (constraints.txt, pip's find-links);
    # transformers is left to colossalai's own pin, so only the torch line of constraints.txt is kept.
    pin = COLOSSAL_VENV.parent / "torch-pin.txt"
    COLOSSAL_VENV.parent.mkdir(parents=True, exist_ok=True)
    torch_lines = [ln for ln in (HERE.parent / "constraints.txt").read_text().splitlines() if ln.startswith("torch==")]
    pin.write_text("\n".join(torch_lines) + "\n")
    pip = [str(py), "-m", "pip", "install", "-q", "-c", str(pin)]
    commands = [
        [sys.executable, "-m", "venv", str(COLOSSAL_VENV)],
        [*pip, *torch_lines],
        [*pip, *COLOSSAL_REQUIREMENTS],
        [*pip, "--no-deps", "colossalai==0.5.0"],
    ]
    with log.open("w") as out:
        for cmd in commands:
            # BUILD_EXT=0: no CUDA/C++ kernels are compiled (there is no GPU; its CPU paths are pure torch).
            res = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "BUILD_EXT": "0"})
            if res.returncode != 0:
                lines = [ln for ln in log.read_text().splitlines() if ln.startswith("ERROR")] or ["(no ERROR line)"]
                return None, f"`{' '.join(cmd[:6])} ...` failed: {lines[-1]}"
    stamp.touch()
    return str(py), "created"


# ---- the driver ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def launch_pair(
    python: str, script: Path, opts: argparse.Namespace, root: str, log: Path, served: int | None
) -> list[subprocess.Popen]:
    """Start the two ranks of one system. ``served``: the port of a store this process serves for them
    (`isthmus.parallel.rendezvous`); None for Colossal-AI, whose launcher makes its group on a free MASTER_PORT
    itself."""
    port = free_port() if served is None else served
    procs = []
    for rank in range(pc.WORLD):
        env = {
            **os.environ,
            **dict(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2"),
            **dict(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), OMP_NUM_THREADS="1"),
            **(served_store_environ(served) if served is not None else {}),
            # Both venvs import isthmus's model and batch sampler from this checkout.
            "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)]),
        }
        cmd = [python, str(script), "--worker", str(rank), "--root", root, "--modes", ",".join(opts.modes)]
        cmd += ["--rounds", str(opts.rounds), "--steps", str(opts.steps), "--warmup", str(opts.warmup)]
        cmd += ["--compile"] if opts.compile else []
        procs.append(subprocess.Popen(cmd, env=env, stdout=log.open("a"), stderr=subprocess.STDOUT))
    return procs


def await_turn(root: str, system: str, r: int, mode: str, procs: list[subprocess.Popen], log: Path) -> dict:
    """The turn's figures, or a RuntimeError naming the pair's last log line if a rank died first."""
    while (res := pc.turn_result(root, system, r, mode)) is None:
        if any(p.poll() not in (None, 0) for p in procs):
            tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-1:] or ["(no output)"]
            raise RuntimeError(f"{system} rank died: {tail[0][:160]}")
        time.sleep(pc.POLL_S)
    return res


def run_rounds(opts: argparse.Namespace, root: str, colossal_py: str | None) -> dict:
    """Start the pairs, wait until both are built, then hand out the turns; returns every figure."""
    pairs = {"project": (sys.executable, Path(__file__).resolve())}
    if colossal_py is not None:
        pairs["colossal"] = (colossal_py, HERE / "peers_colossal.py")
    procs: dict[str, list[subprocess.Popen]] = {}
    logs: dict[str, Path] = {}
    with loopback_store_server() as served:
        try:
            for name, (python, script) in pairs.items():
                logs[name] = Path(root) / f"{name}.log"
                procs[name] = launch_pair(python, script, opts, root, logs[name], served if name == "project" else None)
            return hand_out_turns(opts, root, procs, logs)
        finally:
            _stop(procs)


def _stop(procs: dict[str, list[subprocess.Popen]]) -> None:
    for p in (p for ps in procs.values() for p in ps):
        if p.poll() is None:  # interrupted, or a pair left waiting for a turn that never comes
            p.kill()
            p.wait()


def hand_out_turns(opts: argparse.Namespace, root: str, procs: dict, logs: dict[str, Path]) -> dict:
    na: dict[str, str] = {}
    first_loss: dict[str, float] = {}
    dead: dict[str, str] = {}
    for name in procs:
        try:
            ready = await_turn(root, name, -1, "ready", procs[name], logs[name])
            na.update(ready["na"])
            first_loss.update(ready["first_loss"])
        except RuntimeError as exc:
            dead[name] = str(exc)
    seconds: dict[str, dict[str, list[float]]] = {s: {m: [] for m in opts.modes} for s in (*SYSTEMS, UNSYNCED)}
    for r in range(opts.rounds):
        for mode in opts.modes:
            for name in procs:
                if name in dead:
                    continue
                pc.give_turn(root, name, r, mode)
                try:
                    res = await_turn(root, name, r, mode, procs[name], logs[name])
                except RuntimeError as exc:
                    dead[name] = str(exc)
                    continue
                for system, s in res.items():
                    seconds[system][mode].append(s)
    for name, ps in procs.items():
        for p in ps:
            if p.wait(timeout=120) != 0 and name not in dead:
                dead[name] = f"{name} rank exited with {p.returncode} after its last turn"
    return {"seconds": seconds, "na": na, "dead": dead, "first_loss": first_loss}


def tok_per_s(mode: str, seconds: float, steps: int) -> float:
    return pc.global_batch(mode) * pc.SEQ_LEN * steps / seconds


def cell(system: str, mode: str, res: dict, opts: argparse.Namespace, reason: str) -> str:
    """Median tokens/s over rounds, or "n/a (reason)"."""
    ts = res["seconds"][system][mode]
    if len(ts) == opts.rounds and ts:
        return f"{statistics.median(tok_per_s(mode, s, opts.steps) for s in ts):,.0f}"
    why = res["na"].get(f"{system}/{mode}") or res["dead"].get("colossal" if system == "colossalai" else "project")
    return f"n/a ({why or reason})"


def ratio_cell(mode: str, peer: str, res: dict, opts: argparse.Namespace, system: str = "isthmus") -> str:
    """Median of per-round system/peer tokens/s ratios (> 1: ``system`` faster), then the rounds."""
    mine, theirs = res["seconds"][system][mode], res["seconds"][peer][mode]
    if len(mine) != opts.rounds or len(theirs) != opts.rounds or not mine:
        return "-"
    ratios = [t / m for m, t in zip(mine, theirs)]  # same tokens: the tok/s ratio is the time ratio inverted
    return f"{statistics.median(ratios):.3f} ({', '.join(f'{x:.2f}' for x in ratios)})"


def print_table(res: dict, opts: argparse.Namespace, colossal_note: str) -> None:
    print(
        f"debug shape (6.16M params), fp32, 2 gloo ranks x 1 thread, {opts.rounds} round(s) x {opts.steps} "
        f"timed step(s) (+{opts.warmup} warm-up) per system and mode; tok/s = global tokens per second"
    )
    if opts.compile:
        print(
            "--compile: isthmus (--train.compile true) and torch compile their blocks and loss; Colossal-AI runs eager"
        )
    print()
    print(
        "| mode | isthmus tok/s | torch tok/s | Colossal-AI tok/s | isthmus/torch (rounds) "
        "| isthmus/Colossal-AI (rounds) | step-1 loss isthmus / torch / Colossal-AI |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in opts.modes:
        cells = [cell(s, mode, res, opts, colossal_note) for s in SYSTEMS]
        ratios = [ratio_cell(mode, peer, res, opts) for peer in ("torch", "colossalai")]
        losses = [res["first_loss"].get(f"{s}/{mode}") for s in SYSTEMS]
        loss_cell = " / ".join("-" if v is None else f"{v:.4f}" for v in losses)
        print(f"| {mode} | " + " | ".join([*cells, *ratios, loss_cell]) + " |")
    if "ddp" in opts.modes:
        print()
        print("DDP bound: isthmus's DDP step under no_sync (no gradient all-reduce), timed in isthmus's turns")
        print()
        print("| mode | bound tok/s | bound/Colossal-AI (rounds) | isthmus/bound (rounds) |")
        print("|---|---|---|---|")
        bound = cell(UNSYNCED, "ddp", res, opts, "not measured")
        over_peer = ratio_cell("ddp", "colossalai", res, opts, system=UNSYNCED)
        print(f"| ddp | {bound} | {over_peer} | {ratio_cell('ddp', UNSYNCED, res, opts)} |")


def plot(res: dict, opts: argparse.Namespace, path: str) -> None:
    """Bars per mode: each system's median tokens/s over the rounds; a mode a system could not run
    gets no bar but "n/a"."""
    import plots

    plt = plots.pyplot()
    if plt is None:
        return
    names = {"isthmus": "isthmus", "torch": "hand-written torch", "colossalai": "Colossal-AI 0.5.0"}
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(SYSTEMS)
    for k, system in enumerate(SYSTEMS):
        for i, mode in enumerate(opts.modes):
            x = i + (k - (len(SYSTEMS) - 1) / 2) * width
            ts = res["seconds"][system][mode]
            if len(ts) == opts.rounds and ts:
                rate = statistics.median(tok_per_s(mode, t, opts.steps) for t in ts)
                ax.bar(x, rate, width, color=plots.COLORS[system], label=names[system] if i == 0 else None)
            else:
                ax.text(x, 0, "n/a", rotation=90, ha="center", va="bottom", fontsize=7, color="0.4")
    ax.set_xticks(range(len(opts.modes)), opts.modes)
    ax.set_ylabel("tokens/s (median of rounds)")
    compiled = ", isthmus and torch compiled" if opts.compile else ""
    ax.set_title(
        f"debug shape, 2 gloo ranks x 1 thread, {opts.rounds} rounds x {opts.steps} steps{compiled}", fontsize=9
    )
    handles, labels = ax.get_legend_handles_labels()
    for system in SYSTEMS:  # a system that ran no mode still gets its legend entry
        if names[system] not in labels:
            handles.append(plt.Rectangle((0, 0), 1, 1, color=plots.COLORS[system]))
            labels.append(names[system])
    ax.legend(handles, labels, fontsize=7, ncols=3, loc="upper right")
    plots.save(fig, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default=",".join(pc.MODES), help="comma-separated, of: " + ", ".join(pc.MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per system, mode and round")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each timed block")
    ap.add_argument("--out", default="", help="also write every figure as JSON here")
    ap.add_argument("--no-colossal", action="store_true", help="isthmus and torch only")
    ap.add_argument("--compile", action="store_true", help="isthmus and the torch loop compile their blocks and loss")
    ap.add_argument("--plot", default="", help="also draw tokens/s per mode and system to this file (.svg, .png)")
    ap.add_argument("--worker", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--root", default="", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    opts.modes = [m for m in opts.modes.split(",") if m]
    unknown = [m for m in opts.modes if m not in pc.MODES]
    if unknown or not opts.modes:
        ap.error(f"--modes {','.join(unknown) or '(none)'}: each must be one of {', '.join(pc.MODES)}")
    if min(opts.rounds, opts.steps) < 1 or opts.warmup < 0:
        ap.error("--rounds and --steps must be at least 1, --warmup at least 0")
    # ISTHMUS_MAX_STEPS (a smoke run, as the docs' commands run in the tests) caps every loop, and
    # keeps one round of the first mode: building every mode's systems alone takes a minute here. It
    # times one step without warm-up (the step each system's build runs first warms it): a step of
    # this shape takes over a second here, and a smoke figure means nothing anyway.
    opts.rounds, opts.steps, opts.warmup = capped(opts.rounds), capped(opts.steps), capped(opts.warmup)
    if max_steps_override() is not None and opts.worker < 0:
        opts.rounds, opts.modes, opts.steps, opts.warmup = 1, opts.modes[:1], 1, 0
    return opts


def main() -> None:
    opts = parse_args()
    if opts.worker >= 0:
        project_worker(opts.worker, opts)
        return
    colossal_py, note = None, "--no-colossal"
    with tempfile.TemporaryDirectory() as root:
        if not opts.no_colossal and max_steps_override() is not None:
            # A smoke run must finish in seconds; creating the venv takes minutes.
            note = "skipped under ISTHMUS_MAX_STEPS"
            print(f"Colossal-AI: {note} (its venv would take minutes to create)")
        if max_steps_override() is not None:
            print(f"ISTHMUS_MAX_STEPS: one round of mode {opts.modes[0]} only; the figures mean nothing")
        elif not opts.no_colossal:
            colossal_py, how = colossal_python(COLOSSAL_VENV.parent / "colossalai-venv.log")
            note = how if colossal_py is None else note
            print(f"Colossal-AI venv {COLOSSAL_VENV}: {how}")
        pc.random_tokens(1 << 20).tofile(f"{root}/tokens.bin")
        res = run_rounds(opts, root, colossal_py)
        for name, why in res["dead"].items():
            print(f"{name} pair stopped early: {why}", file=sys.stderr)
        print_table(res, opts, note)
        if opts.plot:
            plot(res, opts, opts.plot)
        if opts.out:
            Path(opts.out).write_text(json.dumps({"opts": vars(opts), **res}, indent=1))
            for log in Path(root).glob("*.log"):  # the pairs' output: tracebacks behind the n/a cells
                Path(f"{opts.out}.{log.name}").write_text(log.read_text())
    if "project" in res["dead"]:
        sys.exit(3)  # isthmus's or torch's own ranks failed: a failed run, whatever the table shows


if __name__ == "__main__":
    main()
