"""Exact parameter and FLOP counts of the decoder in llama.py, from its ModelArgs alone.

FLOPs follow the convention of Megatron-LM (Narayanan et al. 2021) and PaLM: a
multiply-add is 2 FLOPs, training is forward + backward = 3 forwards, and attention
scores/values are counted over the full S x S square (causal masking is not
subtracted), so numbers compare directly with published MFU figures.
"""

from __future__ import annotations

from isthmus.models.args import ModelArgs


def attention_matmul_params(args: ModelArgs) -> int:
    """Weights of one block's attention projections (wq, wk, wv, wo)."""
    q_dim = args.n_heads * args.head_dim
    kv_dim = args.n_kv_heads * args.head_dim
    return args.dim * q_dim + 2 * args.dim * kv_dim + q_dim * args.dim


def dense_mlp_params(args: ModelArgs) -> int:
    """Weights of one dense MLP (w1, w3, w2 for SwiGLU; w1, w2 for GELU)."""
    n_branches = 3 if args.mlp == "swiglu" else 2
    return n_branches * args.dim * args.ffn_dim


def moe_matmul_params(args: ModelArgs, active: bool = False) -> int:
    """Weights of one MoE feed-forward: router gate, routed experts and the shared SwiGLU.

    ``active=True`` counts those one token uses: the router, its ``top_k`` experts and the shared ones.
    """
    expert = 3 * args.dim * args.expert_ffn_dim
    routed = args.top_k if active else args.n_experts
    return args.n_experts * args.dim + (routed + args.n_shared_experts) * expert


def layer_matmul_params(args: ModelArgs, layer: int | None = None, active: bool = False) -> int:
    """Weights of the Linear layers in block ``layer`` (None: the last block, a MoE one in a MoE model).

    ``active=True`` counts only the weights one token multiplies (its top-k experts, not all of them).
    """
    layer = args.n_layers - 1 if layer is None else layer
    ffn = moe_matmul_params(args, active) if args.moe_layer(layer) else dense_mlp_params(args)
    return attention_matmul_params(args) + ffn


def count_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Exact number of parameters of ``build_model(args)`` (a MoE router's expert_bias and q/k norms included).

    ``include_embedding=False`` leaves out the token-embedding table (and with it a
    tied head, which is the same matrix); an untied head is a matmul and stays.
    """
    blocks = sum(layer_matmul_params(args, i) for i in range(args.n_layers))
    blocks += args.n_layers * 2 * args.dim  # two RMSNorm scales per block
    blocks += args.n_moe_layers * args.n_experts  # the routers' expert_bias
    blocks += args.n_layers * 2 * args.head_dim if args.qk_norm else 0  # Qwen3's q/k norm scales
    total = blocks + args.dim  # final norm
    table = args.vocab_size * args.dim
    if include_embedding:
        total += table
    if not args.tie_embeddings:
        total += table
    return total


def active_params(args: ModelArgs, include_embedding: bool = True) -> int:
    """Parameters one token uses: `count_params` less the routed experts it is not sent to.

    The figure MoE papers quote as "active" (Mixtral 8x7B: 12.9B of 46.7B); equal to `count_params`
    for a dense model.
    """
    idle = (args.n_experts - args.top_k) * 3 * args.dim * args.expert_ffn_dim
    return count_params(args, include_embedding) - args.n_moe_layers * idle


def matmul_params(args: ModelArgs) -> int:
    """Parameters used in a matmul per token: all Linears and the head (tied or not).

    The embedding is a gather and norms are elementwise, so neither counts. In a MoE layer only the
    router and the token's top-k (and shared) experts count: FLOPs follow the active weights, as MoE
    MFU figures are published.
    """
    blocks = sum(layer_matmul_params(args, i, active=True) for i in range(args.n_layers))
    return blocks + args.vocab_size * args.dim


def attention_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Forward FLOPs per token of QK^T and AV over all layers (2 matmuls x 2 FLOP/MAC).

    Each query head scores against all ``seq_len`` keys and mixes as many values: grouped-query
    attention shares K and V between heads but not this work, so it is ``n_heads``, not
    ``n_kv_heads``. Causal attention is counted over the full S x S square too, although the mask
    leaves half of it unused and torch's flash kernels skip the blocks above the diagonal: the
    convention of Megatron-LM and PaLM (12 L H Q T per token for training) and torchtitan, so MFU
    compares with theirs. At the default run's shape (``small``, S = 128) attention is 8% of the
    training FLOPs, so counting only the causal half would lower MFU by 4%.
    """
    return 4 * args.n_layers * seq_len * args.n_heads * args.head_dim


def forward_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Forward FLOPs per token: weight matmuls plus attention."""
    return 2 * matmul_params(args) + attention_flops_per_token(args, seq_len)


def flops_per_token(args: ModelArgs, seq_len: int, recompute: bool = False) -> int:
    """Training FLOPs per token: 3 forwards, plus one forward of the blocks if recomputed.

    Full activation recomputation re-runs each block's forward before its backward;
    the output head is not recomputed, exactly as Megatron's Eq. 3 counts it.
    """
    total = 3 * forward_flops_per_token(args, seq_len)
    if recompute:
        blocks = sum(layer_matmul_params(args, i, active=True) for i in range(args.n_layers))
        total += 2 * blocks + attention_flops_per_token(args, seq_len)
    return total


def megatron_flops_per_iteration(batch: int, seq_len: int, n_layers: int, hidden: int, vocab: int) -> int:
    """Eq. 3 of Narayanan et al. 2021: 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h)), in integers.

    Expanded so no division happens: 96Bslh^2 + 16Bs^2lh + 6BsVh. It assumes
    multi-head attention (QKV = 3h^2), a 4h GELU MLP and full recomputation.
    """
    b, s, l, h, v = batch, seq_len, n_layers, hidden, vocab
    return 96 * b * s * l * h * h + 16 * b * s * s * l * h + 6 * b * s * v * h
