"""Named model shapes: test and CPU-demo sizes, Llama 3, the Megatron-LM GPT-3 family and MoE models."""

from __future__ import annotations

from isthmus.errors import ConfigError
from isthmus.models.args import ModelArgs

GPT_VOCAB = 51200
"""Vocabulary of the Megatron GPT runs (GPT-2 BPE padded to a multiple of 1024)."""

LLAMA3_VOCAB = 128256

# Narayanan et al. 2021 (Megatron-LM), Table 1: (name, heads, hidden, layers).
# Copied from shared/reference/megatron_2021_table1.csv so the package never reads it.
# Our counts (tied embeddings, RMSNorm without bias, RoPE instead of learned
# positions, no Linear biases) against the table's params_b:
#   1.7b  1.647B (-3.1%)    3.6b  3.555B (-1.3%)    7.5b  7.458B (-0.6%)
#   18.4b 18.434B (+0.2%)   39.1b 39.075B (-0.1%)   76.1b 76.023B (-0.1%)
#   145.6b .. 1t within 0.02%.
# The small rows differ most because the paper's count adds learned position
# embeddings (s*h) and biases; even its own formula gives 1.652B for "1.7".
GPT3_TABLE: tuple[tuple[str, int, int, int], ...] = (
    ("gpt3-1.7b", 24, 2304, 24),
    ("gpt3-3.6b", 32, 3072, 30),
    ("gpt3-7.5b", 32, 4096, 36),
    ("gpt3-18.4b", 48, 6144, 40),
    ("gpt3-39.1b", 64, 8192, 48),
    ("gpt3-76.1b", 80, 10240, 60),
    ("gpt3-145.6b", 96, 12288, 80),
    ("gpt3-310.1b", 128, 16384, 96),
    ("gpt3-529.6b", 128, 20480, 105),
    ("gpt3-1t", 160, 25600, 128),
)


def gpt3(heads: int, hidden: int, layers: int) -> ModelArgs:
    """A GPT-3-style shape: multi-head attention, 4h GELU MLP, shared input/output embedding."""
    return ModelArgs(
        dim=hidden,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=heads,
        ffn_dim=4 * hidden,
        vocab_size=GPT_VOCAB,
        mlp="gelu",
        tie_embeddings=True,
    )


def llama3(dim: int, n_layers: int, n_heads: int, ffn_dim: int) -> ModelArgs:
    """A Llama 3 shape: 8 KV heads, SwiGLU, untied head, rope_theta 500000."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=LLAMA3_VOCAB,
        rope_theta=500000.0,
    )


def mixtral(dim: int, n_layers: int, n_heads: int, ffn_dim: int, vocab_size: int) -> ModelArgs:
    """A Mixtral shape: 8 KV heads, 8 SwiGLU experts of width ffn_dim, top-2, rope_theta 1e6."""
    return ModelArgs(
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=8,
        ffn_dim=ffn_dim,
        vocab_size=vocab_size,
        rope_theta=1e6,
        n_experts=8,
        top_k=2,
    )


FLAVORS: dict[str, ModelArgs] = {
    # Byte-level sizes: vocab 256 needs no tokenizer.
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=256),
    "small": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=256),
    # torchtitan's debug model, the shape of benchmarks/peers.py; its vocab 2048 wants a BPE tokenizer
    # (--data.tokenizer bpe --data.bpe_vocab_size 2048), else the vocabulary follows the byte tokenizer's 256.
    "debug": ModelArgs(dim=256, n_layers=6, n_heads=16, n_kv_heads=16, ffn_dim=768, vocab_size=2048),
    "llama3-8b": llama3(4096, 32, 32, 14336),
    "llama3-70b": llama3(8192, 80, 64, 28672),
    "llama3-405b": llama3(16384, 126, 128, 53248),
    **{name: gpt3(heads, hidden, layers) for name, heads, hidden, layers in GPT3_TABLE},
    # Mixture-of-Experts: byte-level test and CPU-demo sizes, then published shapes for planning.
    "moe-tiny": ModelArgs(
        dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=256, n_experts=4, top_k=2, moe_ffn_dim=64
    ),
    "moe-small": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=704,
        vocab_size=256,
        n_experts=8,
        top_k=2,
        moe_ffn_dim=256,
        n_shared_experts=1,
    ),
    "mixtral-8x7b": mixtral(4096, 32, 32, 14336, 32000),
    "mixtral-8x22b": mixtral(6144, 56, 48, 16384, 32768),
    # Qwen3's attention is 32 heads of 128 (q width 4096 != dim 2048), which ModelArgs (head_dim = dim / n_heads)
    # cannot express: the nearest shape keeps the heads at 64 wide, so attention has half its published
    # weights (4 x 9.4M of 18.9M per layer; the experts, 604M per layer, are exact).
    "qwen3-30b-a3b": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e6,
        n_experts=128,
        top_k=8,
        moe_ffn_dim=768,
    ),
    # Qwen2's sigmoid gate on the shared expert is not modelled (dim parameters per layer).
    "qwen2-57b-a14b": ModelArgs(
        dim=3584,
        n_layers=28,
        n_heads=28,
        n_kv_heads=4,
        ffn_dim=18944,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e6,
        n_experts=64,
        top_k=8,
        moe_ffn_dim=2560,
        n_shared_experts=8,
        router_norm_topk=False,
    ),
    # DeepSeek-V3 with multi-head attention standing in for MLA, no multi-token prediction head and
    # plain top-k routing (no expert groups, no routed scaling factor).
    "deepseek-v3-like": ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        ffn_dim=18432,
        vocab_size=129280,
        norm_eps=1e-6,
        n_experts=256,
        top_k=8,
        moe_ffn_dim=2048,
        n_shared_experts=1,
        n_dense_layers=3,
        router_score="sigmoid",
        load_balance="bias",
    ),
}


def list_flavors() -> list[str]:
    """Flavor names in definition order (small to large within each family)."""
    return list(FLAVORS)


def get_flavor(name: str) -> ModelArgs:
    """The ModelArgs of a named flavor; ConfigError for an unknown name."""
    try:
        return FLAVORS[name]
    except KeyError:
        raise ConfigError("model.flavor", name, f"unknown flavor; choose one of: {', '.join(FLAVORS)}") from None
