"""Colossal-AI 0.5.0's side of benchmarks/peers.py: one rank of its process pair, in Colossal-AI's own venv.

Launched by peers.py (never by hand) with that venv's python, RANK/WORLD_SIZE/MASTER_* set and
PYTHONPATH naming this checkout's src/ and benchmarks/. Plugins per mode:

- ddp: TorchDDPPlugin; zero1 / zero2: LowLevelZeroPlugin(stage=1 / 2);
- zero3: TorchFSDPPlugin (torch's FSDP1, FULL_SHARD, one unit per transformer block; GeminiPlugin,
  Colossal-AI's own ZeRO-3 built for GPU memory management, was not tried);
- tp / tp_sp: HybridParallelPlugin(tp_size=2[, enable_sequence_parallelism, "split_gather"]);
- pp: HybridParallelPlugin(pp_size=2, num_microbatches=4) (its default schedule is 1F1B);
- cp: HybridParallelPlugin(sp_size=2, sequence_parallelism_mode="ring_attn"), Colossal-AI's ring attention.

DDP and ZeRO train isthmus's own Llama (`isthmus.models.llama`, pure torch); HybridParallelPlugin
shards only Hugging Face models it has a policy for, so TP/PP/CP train transformers' LlamaForCausalLM
of the same shape (its loss covers 255 of the 256 positions: labels are the inputs, shifted inside).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

import peers_common as pc
from peers import parse_args


def patch_cpu_accelerator() -> None:
    """Give Colossal-AI's CPU accelerator torch's CPU equivalents of what its TP/PP paths call.

    CpuAccelerator raises "not supported" for these; on CPU each has an exact torch counterpart."""
    from colossalai.accelerator.cpu_accelerator import CpuAccelerator as Cpu

    # Random state: its dropout/seed bookkeeping saves and restores the device RNG; on CPU that is torch's.
    Cpu.get_rng_state = lambda self, device=None: torch.get_rng_state()
    Cpu.set_rng_state = lambda self, new_state, device=None: torch.set_rng_state(new_state)
    Cpu.manual_seed = lambda self, seed: torch.manual_seed(seed)
    Cpu.seed = lambda self: torch.seed()
    Cpu.initial_seed = lambda self: torch.initial_seed()
    # CPU ops run synchronously and there is no cache allocator to empty: nothing to do.
    Cpu.synchronize = lambda self, device=None: None
    Cpu.empty_cache = lambda self: None
    # Not the accelerator, but torch: its pipeline p2p asks torch.distributed.is_hccl_available(), which
    # torch 2.13 no longer has (Colossal-AI 0.5.0 pins torch <= 2.5.1). HCCL is Ascend's backend: not here.
    if not hasattr(torch.distributed, "is_hccl_available"):
        torch.distributed.is_hccl_available = lambda: False


def hf_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    s = pc.SHAPE
    torch.manual_seed(pc.SEED)
    cfg = LlamaConfig(
        hidden_size=s["dim"],
        num_hidden_layers=s["n_layers"],
        num_attention_heads=s["n_heads"],
        num_key_value_heads=s["n_kv_heads"],
        intermediate_size=s["ffn_dim"],
        vocab_size=s["vocab_size"],
        max_position_embeddings=pc.SEQ_LEN,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def isthmus_llama() -> torch.nn.Module:
    from isthmus.models.args import ModelArgs
    from isthmus.models.llama import build_model, init_weights

    a = ModelArgs(**pc.SHAPE)
    model = build_model(a, device="cpu")
    init_weights(model, pc.SEED, a)
    return model


def plugin_for(mode: str) -> object:
    from colossalai.booster.plugin import HybridParallelPlugin, LowLevelZeroPlugin, TorchDDPPlugin, TorchFSDPPlugin

    hybrid = dict(precision="fp32", max_norm=pc.GRAD_CLIP)
    if mode == "ddp":
        return TorchDDPPlugin()
    if mode in ("zero1", "zero2"):
        return LowLevelZeroPlugin(stage=int(mode[-1]), precision="fp32", max_norm=pc.GRAD_CLIP)
    if mode == "zero3":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from isthmus.models.llama import TransformerBlock

        return TorchFSDPPlugin(auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    if mode == "tp":
        return HybridParallelPlugin(tp_size=2, pp_size=1, **hybrid)
    if mode == "tp_sp":
        return HybridParallelPlugin(
            tp_size=2, pp_size=1, enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather", **hybrid
        )
    if mode == "pp":
        return HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=pc.MICROBATCHES, **hybrid)
    assert mode == "cp", mode
    return HybridParallelPlugin(
        tp_size=1,
        pp_size=1,
        sp_size=2,
        enable_sequence_parallelism=True,
        sequence_parallelism_mode="ring_attn",
        **hybrid,
    )


def colossal_step(mode: str, tokens: object) -> pc.Step:
    """Boost the mode's model and return one training step on the shared batch order."""
    from colossalai.booster import Booster

    from isthmus.data.loader import BatchSampler

    rank = torch.distributed.get_rank()
    batch = pc.global_batch(mode)
    sampler = BatchSampler(tokens, pc.SEQ_LEN, pc.SEED)
    plugin = plugin_for(mode)
    hf = mode not in pc.DATA_PARALLEL
    model = hf_llama() if hf else isthmus_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=pc.LR, betas=(0.9, 0.95), weight_decay=0.1)

    def hf_loss(outputs: object, inputs: object) -> torch.Tensor:
        return outputs.loss  # type: ignore[attr-defined]

    booster = Booster(plugin=plugin)
    model, opt, _, _, _ = booster.boost(model, opt, criterion=hf_loss if hf else None)
    clip: Callable[[], None] = (
        (lambda: opt.clip_grad_by_norm(pc.GRAD_CLIP)) if mode in ("ddp", "zero3") else (lambda: None)
    )  # the other plugins clip inside step() (their max_norm)

    def step() -> float | None:
        loss: torch.Tensor | None
        if mode in pc.DATA_PARALLEL:
            x, y = sampler.next_batch(batch, rank, pc.WORLD)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
            booster.backward(loss, opt)
            torch.distributed.all_reduce(loss := loss.detach())  # the mean over ranks, as isthmus reports it
            loss /= pc.WORLD
        elif mode == "pp":
            x, _ = sampler.next_batch(batch, 0, 1)
            out = booster.execute_pipeline(iter([{"input_ids": x, "labels": x}]), model, hf_loss, opt, return_loss=True)
            loss = out["loss"]  # None on the first stage
        else:
            x, _ = sampler.next_batch(batch, 0, 1)
            # An all-ones mask: its ring attention splits the labels only when told no token is padding.
            mask = torch.ones_like(x)
            loss = hf_loss(model(input_ids=x, attention_mask=mask, labels=x), None)
            booster.backward(loss, opt)
        clip()
        opt.step()
        opt.zero_grad()
        return None if loss is None else float(loss)

    return step


def main() -> None:
    opts = parse_args()
    rank = opts.worker
    torch.set_num_threads(1)  # 2 ranks on 2 cores, as on the project's side
    patch_cpu_accelerator()
    import colossalai
    import numpy as np

    # Its launcher makes the process group itself, on its accelerator's backend: gloo on CPU.
    colossalai.launch_from_torch(seed=pc.SEED, verbose=False)
    from isthmus.config import DataConfig
    from isthmus.data.corpus import split_tokens

    # The windows isthmus's trainer draws from: the training part of the same file, split the same way.
    path = f"{opts.root}/tokens.bin"
    tokens, _ = split_tokens(np.fromfile(path, dtype=np.uint16), DataConfig(path=path), pc.SEQ_LEN)
    steps: dict[str, pc.Step] = {}
    na: dict[str, str] = {}
    first_loss: dict[str, float] = {}
    for mode in opts.modes:
        if (step := pc.probe(f"colossalai/{mode}", lambda: colossal_step(mode, tokens), first_loss, na)) is not None:
            steps[mode] = step
    pc.report_ready(opts.root, "colossal", na, first_loss)
    for r in range(opts.rounds):
        for mode in opts.modes:
            pc.wait_turn(opts.root, "colossal", r, mode)
            seconds = {"colossalai": pc.time_block(steps[mode], opts.warmup, opts.steps)} if mode in steps else {}
            if rank == 0:
                pc.finish_turn(opts.root, "colossal", r, mode, seconds)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
