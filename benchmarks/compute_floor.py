"""The least time a step of benchmarks/peers.py's shape can take here: its matmuls and attention alone.

    python benchmarks/compute_floor.py                       # each mode's floor per step, one rank
    python benchmarks/compute_floor.py --peers peers.json    # beside a `peers.py --out` file

Each rank of peers.py computes on one thread. Its step cannot be faster than the matmuls of the
linear layers (forward, input gradient, weight gradient) and the attention kernel (torch's SDPA,
causal, forward and backward) of the rank's share of the model, timed here alone on one thread,
best of ``--repeats``. Everything else a step does is left out (norms, SwiGLU, residuals, the loss,
the optimizer, every collective, the pipeline's idle time beyond its fill and drain), so the floor
is below any real step of any system. Shares per mode, as peers.py splits the debug shape:

- DP and ZeRO: the whole model on each rank's 8 sequences;
- TP and TP + SP: half of each projection (columns of wq/wk/wv/w1/w3, rows of wo/w2), half of the
  heads and of the vocabulary-parallel head, on the shared 8 sequences;
- PP: 3 blocks per stage (the last with the head), 4 microbatches of 2 sequences; two-stage 1F1B
  cannot beat m x (the slower stage's microbatch) + one microbatch of the other stage.

The ceiling is a mode's global tokens per step over its floor. With ``--peers``, each system's
median tokens/s from that file is printed beside the ceiling, and so is 1.2x each peer's rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peers_common as pc  # noqa: E402
from isthmus.profile.measure import best_time  # noqa: E402
from isthmus.train.short_run import capped  # noqa: E402

MODES = ("ddp", "tp", "pp")  # the modes' shares; zero1-3 compute as ddp, tp_sp as tp
SHARE = {"ddp": "ddp", "zero1": "ddp", "zero2": "ddp", "zero3": "ddp", "tp": "tp", "tp_sp": "tp", "pp": "pp"}


def linear_s(tokens: int, n_in: int, n_out: int, repeats: int) -> float:
    """A linear layer's three matmuls: forward, the input's gradient and the weight's."""
    x, w, g = torch.randn(tokens, n_in), torch.randn(n_out, n_in), torch.randn(tokens, n_out)
    return sum(best_time(fn, 0.0, repeats) for fn in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x))


def attention_s(sequences: int, heads: int, seq: int, head_dim: int, repeats: int) -> float:
    """Causal SDPA forward and backward (torch picks its CPU kernel, as the trainers do)."""
    q, k, v = (torch.randn(sequences, heads, seq, head_dim, requires_grad=True) for _ in range(3))
    return best_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward(), 0.0, repeats)


def blocks_s(sequences: int, n_blocks: int, split: int, repeats: int) -> tuple[float, float]:
    """(matmuls, attention) seconds of ``n_blocks`` blocks on ``sequences``, each projection and the heads / ``split``."""
    d, ffn, heads = pc.SHAPE["dim"], pc.SHAPE["ffn_dim"], pc.SHAPE["n_heads"]
    tokens = sequences * pc.SEQ_LEN
    per_block = (
        3 * linear_s(tokens, d, d // split, repeats)  # wq, wk, wv: columns
        + linear_s(tokens, d // split, d, repeats)  # wo: rows
        + 2 * linear_s(tokens, d, ffn // split, repeats)  # w1, w3: columns
        + linear_s(tokens, ffn // split, d, repeats)  # w2: rows
    )
    attention = attention_s(sequences, heads // split, pc.SEQ_LEN, d // heads, repeats)
    return n_blocks * per_block, n_blocks * attention


def head_s(sequences: int, split: int, repeats: int) -> float:
    return linear_s(sequences * pc.SEQ_LEN, pc.SHAPE["dim"], pc.SHAPE["vocab_size"] // split, repeats)


def floor_s(share: str, repeats: int) -> dict[str, float]:
    """One rank's matmul and attention seconds per step, and the floor of its step, for one mode's share."""
    layers = pc.SHAPE["n_layers"]
    if share == "pp":
        micro = pc.PER_RANK // pc.MICROBATCHES
        first_mm, first_att = blocks_s(micro, layers // 2, 1, repeats)
        last_mm, last_att = blocks_s(micro, layers - layers // 2, 1, repeats)
        last_mm += head_s(micro, 1, repeats)
        first, last = first_mm + first_att, last_mm + last_att
        m = pc.MICROBATCHES
        return {
            "matmul_s": m * max(first_mm, last_mm),
            "attention_s": m * max(first_att, last_att),
            "floor_s": max(m * last + first, m * first + last),
        }
    split = 2 if share == "tp" else 1
    mm, att = blocks_s(pc.PER_RANK, layers, split, repeats)
    mm += head_s(pc.PER_RANK, split, repeats)
    return {"matmul_s": mm, "attention_s": att, "floor_s": mm + att}


def peer_rates(path: Path) -> dict[str, dict[str, float]]:
    """Each system's median tokens/s per mode from a `peers.py --out` file (modes it did not run left out)."""
    res = json.loads(path.read_text())
    steps = res["opts"]["steps"]
    return {
        system: {
            mode: statistics.median(pc.global_batch(mode) * pc.SEQ_LEN * steps / s for s in times)
            for mode, times in by_mode.items()
            if times
        }
        for system, by_mode in res["seconds"].items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per matmul / attention (the fastest counts)")
    ap.add_argument("--peers", type=Path, help="a `benchmarks/peers.py --out` JSON: its tokens/s beside the ceilings")
    opts = ap.parse_args()
    repeats = capped(opts.repeats)
    torch.manual_seed(pc.SEED)
    torch.set_num_threads(1)  # as each rank of peers.py
    floors = {share: floor_s(share, repeats) for share in MODES}
    rates = peer_rates(opts.peers) if opts.peers else {}
    modes = [m for m in SHARE if not rates or any(m in r for r in rates.values())]
    print(
        f"debug shape, one thread per rank, best of {repeats}: each mode's matmuls and attention per rank and step "
        "(nothing else counted); ceiling = global tokens per step / floor"
    )
    print()
    head = "| mode | matmuls ms | attention ms | floor ms | ceiling tok/s |"
    rule = "|---|---:|---:|---:|---:|"
    for system in rates:
        head += f" {system} tok/s | 1.2x {system} |"
        rule += "---:|---:|"
    print(head)
    print(rule)
    for mode in modes:
        f = floors[SHARE[mode]]
        ceiling = pc.global_batch(mode) * pc.SEQ_LEN / f["floor_s"]
        row = f"| {mode} | {f['matmul_s'] * 1e3:.0f} | {f['attention_s'] * 1e3:.0f} | {f['floor_s'] * 1e3:.0f} | {ceiling:,.0f} |"
        for system in rates:
            rate = rates[system].get(mode)
            row += (
                " - | - |"
                if rate is None
                else f" {rate:,.0f} | {1.2 * rate:,.0f} ({1.2 * rate / ceiling:.2f} of the ceiling) |"
            )
        print(row)


if __name__ == "__main__":
    main()
