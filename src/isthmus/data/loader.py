"""Deterministic, resumable batches of token windows, sliced for data-parallel ranks.

The sampler's position is a count of *global* samples, not of any rank's share: every rank
draws the same global batch, keeps its contiguous slice and advances by the whole batch. The
ranks' slices therefore concatenate to exactly the single-process batch, which is what makes a
data-parallel run equal to one process, and a checkpoint resumable at another dp size.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from isthmus.errors import DataError

Batch = tuple[torch.Tensor, torch.Tensor]


def rank_slice(global_batch: int, dp_rank: int, dp_size: int) -> slice:
    """This rank's contiguous share of a global batch."""
    assert dp_size >= 1 and 0 <= dp_rank < dp_size, (dp_rank, dp_size)
    assert global_batch % dp_size == 0, f"global batch {global_batch} is not divisible by dp size {dp_size}"
    per_rank = global_batch // dp_size
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def gather_windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """Inputs ``tokens[s : s+seq_len]`` and targets shifted by one, as int64 ``[len(starts), seq_len]``."""
    idx = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(seq_len + 1, dtype=np.int64)
    # Fancy indexing copies only these windows out of a memmap, never the whole file.
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class BatchSampler:
    """Seeded epochs over the non-overlapping windows ``tokens[i*L : i*L + L + 1]``.

    Epoch e visits the windows in the order ``default_rng((seed, e)).permutation(n_windows)``,
    so any position (epoch, offset) is reproducible from the seed alone.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int) -> None:
        assert seq_len >= 1, seq_len
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        # The last window needs one extra token for its final target.
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise DataError(f"{len(tokens)} tokens hold no window of train.seq_len {seq_len} + 1")
        self.epoch = 0
        self.offset = 0
        self._perms: dict[int, np.ndarray] = {}

    @property
    def samples_seen(self) -> int:
        """Global samples drawn so far, over all ranks and epochs."""
        return self.epoch * self.n_windows + self.offset

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            # A batch spans at most a few epochs; keep only the newest to bound memory.
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.n_windows)
        return self._perms[epoch]

    def _ids_from(self, epoch: int, offset: int, count: int) -> tuple[np.ndarray, int, int]:
        """The next count window indices from (epoch, offset), and the position after them."""
        parts: list[np.ndarray] = []
        while count > 0:
            take = min(count, self.n_windows - offset)
            parts.append(self._perm(epoch)[offset : offset + take])
            count -= take
            offset += take
            if offset == self.n_windows:
                epoch, offset = epoch + 1, 0
        ids = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return ids, epoch, offset

    def sample_ids(self, global_batch: int) -> np.ndarray:
        """The window indices of the next global batch, without advancing."""
        return self._ids_from(self.epoch, self.offset, global_batch)[0]

    def next_batch(self, global_batch: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """This rank's slice of the next global batch; advances by the whole global batch."""
        assert global_batch >= 1, global_batch
        share = rank_slice(global_batch, dp_rank, dp_size)
        ids, self.epoch, self.offset = self._ids_from(self.epoch, self.offset, global_batch)
        return gather_windows(self.tokens, ids[share] * self.seq_len, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "samples_seen": self.samples_seen,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "n_windows": self.n_windows,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; the seed, seq_len and data must be those it was saved with."""
        for key, mine in (("seed", self.seed), ("seq_len", self.seq_len), ("n_windows", self.n_windows)):
            if key in state and int(state[key]) != mine:
                raise DataError(
                    f"data loader checkpoint: {key} {int(state[key])} differs from this run's {mine}; "
                    "resume with the same data, train.seed and train.seq_len"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset < self.n_windows:
            raise DataError(f"data loader checkpoint: position epoch {epoch} offset {offset} is out of range")
        self.epoch, self.offset = epoch, offset


def val_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int, dp_rank: int = 0, dp_size: int = 1
) -> list[Batch]:
    """Fixed validation batches: windows evenly spaced over tokens, the same on every run.

    Each batch is sliced for the rank like `BatchSampler.next_batch`, so the ranks' losses
    average to the single-process loss. Windows may overlap when the split is small.
    """
    assert batch_size >= 1 and n_batches >= 1, (batch_size, n_batches)
    if len(tokens) < seq_len + 1:
        raise DataError(f"validation split: {len(tokens)} tokens is too few for train.seq_len {seq_len} + 1")
    share = rank_slice(batch_size, dp_rank, dp_size)
    starts = np.linspace(0, len(tokens) - seq_len - 1, batch_size * n_batches).round().astype(np.int64)
    return [
        gather_windows(tokens, starts[b * batch_size : (b + 1) * batch_size][share], seq_len) for b in range(n_batches)
    ]
