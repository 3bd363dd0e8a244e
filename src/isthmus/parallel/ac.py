"""Activation checkpointing of transformer blocks: recompute in backward instead of storing."""

from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from isthmus.models.llama import Transformer


def apply_ac(model: Transformer, mode: str) -> None:
    """``full``: every block; ``selective``: every other block (half the saved activations, half the recompute).

    Wrapped blocks keep their parameter names up to the ``_checkpoint_wrapped_module`` prefix, which
    `isthmus.models.llama.canonical_name` strips, so initialisation and checkpoints are unaffected.
    """
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
