"""Bytes on the WAN of the lossy encodings, without torch: what the runtime's codecs send and what the
planner prices are the same formulas.

- Compressed pipeline boundaries (``geo.pp_compression``, the codecs of
  ``isthmus.parallel.boundary_codec``): :func:`wire_bytes` and :func:`encode_flops` of one
  ``(tokens, dim)`` activation or gradient.
- SparseLoCo-style outer gradients (``geo.outer_dtype = "topk2"``, ``isthmus.geo.sparse``):
  :func:`topk2_payload_nbytes` of ``numel`` elements in chunks of ``block_size``.
"""

from __future__ import annotations

SCALE_BYTES = 4
"""One fp32 scale per token (row) for int8 and int4."""

QMAX = {"int8": 127, "int4": 7}
"""Largest code of each quantised boundary encoding (codes are -qmax..qmax)."""

MAX_CHUNK = 65536
"""Largest topk2 chunk whose offsets fit two bytes."""


def wire_bytes(method: str, tokens: int, dim: int, elem_bytes: int, rank: int) -> int:
    """Bytes one ``(tokens, dim)`` boundary tensor of ``elem_bytes`` elements takes on the wire."""
    if method == "none":
        return tokens * dim * elem_bytes
    if method == "int8":
        return tokens * (dim + SCALE_BYTES)
    if method == "int4":
        return tokens * ((dim + 1) // 2 + SCALE_BYTES)
    if method == "lowrank":
        return (tokens + dim) * min(rank, dim) * elem_bytes
    raise ValueError(f"unknown boundary compression {method!r}")


def encode_flops(method: str, tokens: int, dim: int, rank: int) -> float:
    """Arithmetic of encoding and decoding one ``(tokens, dim)`` tensor, for the cost model: a few
    elementwise passes for quantisation; for lowrank one power iteration (``X Q``, ``X^T (X Q)``),
    a QR of ``dim x r``, ``C = X Q`` and the receiver's ``C Q^T``."""
    n = tokens * dim
    if method == "none":
        return 0.0
    if method in QMAX:
        return 6.0 * n  # absmax, divide, round, clamp; decode: multiply (and unpack)
    if method == "lowrank":
        r = min(rank, dim)
        return 4.0 * n * r + 2.0 * n * r + 2.0 * n * r + 4.0 * dim * r * r
    raise ValueError(f"unknown boundary compression {method!r}")


def topk2_chunk_k(block_size: int, density: float) -> int:
    """Entries sent per chunk of ``block_size`` at ``density``: round(density * block_size), at least 1."""
    return max(1, min(block_size, round(density * block_size)))


def topk2_offset_bytes(block_size: int) -> int:
    """Bytes per offset inside a chunk: 1 up to 256 elements, else 2."""
    assert block_size <= MAX_CHUNK, f"chunk of {block_size} elements: offsets need more than 2 bytes"
    return 1 if block_size <= 256 else 2


def n_chunks(numel: int, block_size: int) -> int:
    """Chunks of ``block_size`` that cover ``numel`` elements (the last one padded)."""
    return -(-numel // block_size)


def topk2_payload_nbytes(numel: int, block_size: int, k: int) -> int:
    """Bytes on the wire for ``numel`` elements: offsets, 2-bit codes (4 per byte), two bf16 levels a chunk."""
    sent = n_chunks(numel, block_size) * k
    return sent * topk2_offset_bytes(block_size) + -(-sent // 4) + 4 * n_chunks(numel, block_size)
