"""torch.compile of the transformer blocks and the loss (``train.compile``), torchtitan's way.

Each block is compiled on its own rather than the whole model: the blocks run one code object on
same-shaped tensors, so one compilation serves all of them, and what runs between blocks (FSDP2's
gathers and reduce-scatters, pipeline sends, DDP's bucket hooks) stays eager where those
wrappers expect it. Inductor fuses each block's elementwise work (norms, RoPE, SwiGLU, residuals)
into a few kernels around the matmuls.

Order inside `apply_layout`: after tensor and context parallelism and activation checkpointing, so
the compiled graph holds the sharded ops and the recomputation, and before FSDP2, so its hooks
wrap the compiled block instead of being traced into it. The compiled block is registered in the
block's place (``torch.compile`` wraps it in an ``OptimizedModule``): its parameters gain an
``_orig_mod`` component, which `isthmus.models.llama.canonical_name` drops, so initialisation and
checkpoints see the bare model's names.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

from isthmus.errors import ConfigError
from isthmus.models.llama import Transformer


def check_cpu_toolchain() -> None:
    """On CPU inductor builds its kernels with a C++ compiler; without one the first step would fail
    deep in a compilation, so say it in one line before any work (preflight, for CPU runs)."""
    try:
        # Private, but it is inductor's own search (the CXX variable, then g++): asking it finds
        # exactly the compiler the first step would use.
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:  # moved in another torch: let inductor say it
        return
    try:
        get_cpp_compiler()
    except Exception as e:  # torch._inductor.exc.InvalidCxxCompiler
        raise ConfigError(
            "train.compile",
            True,
            "needs a C++ compiler on CPU (inductor builds its kernels with one): install g++ or set CXX",
        ) from e


def _own_input(_: nn.Module, args: tuple) -> tuple:
    """A block's input that is a view gets a copy of its own. Tensor parallelism's embedding hands the
    first block its output as a view of a DTensor's local shard; AOTAutograd regenerates an input
    view from its base, which routes the gradient past DTensor's autograd functions (in torch 2.13
    the backward fails: "'Tensor' object has no attribute '_local_tensor'"). One copy of
    one activation, on the first block only (the others take a compiled block's fresh output)."""
    x = args[0]
    if isinstance(x, Tensor) and x._base is not None:
        return (x.clone(), *args[1:])
    return args


def compile_blocks(model: Transformer) -> None:
    """Replace each of ``model``'s blocks by its compiled self (same parameters, same results up to
    floating-point reassociation)."""
    for name, block in list(model.layers.items()):
        compiled = cast(nn.Module, torch.compile(block))  # an OptimizedModule, typed as a callable
        # On the compiled wrapper, so that it runs eagerly, before the compiled region.
        compiled.register_forward_pre_hook(_own_input)
        model.layers[name] = compiled
