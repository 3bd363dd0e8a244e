"""The dense MLP of a transformer block, and of a MoE layer's shared experts."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class FeedForward(nn.Module):
    """SwiGLU MLP (``w2(silu(w1 x) * w3 x)``) or GELU MLP (``w2(gelu(w1 x))``)."""

    def __init__(self, dim: int, ffn_dim: int, mlp: str) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False) if mlp == "swiglu" else None

    def forward(self, x: Tensor) -> Tensor:
        if self.w3 is None:
            return self.w2(F.gelu(self.w1(x)))
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
