"""Batches as a pure function of (seed, step): resuming needs nothing but the step number."""

from __future__ import annotations

import numpy as np
import torch

from lowbit.data.dataset import TokenSplit
from lowbit.errors import LowbitError


class Loader:
    """Sample order: epoch after epoch, each a fresh permutation of all windows. Global batch s is
    samples [s*B, (s+1)*B) of that sequence (it may straddle two epochs); data-parallel rank r takes
    the r-th contiguous slice, so the ranks' union is the same for every dp_size."""

    def __init__(self, split: TokenSplit, seq_len: int, global_batch: int, seed: int,
                 dp_rank: int = 0, dp_size: int = 1):
        self.split = split
        self.seq_len = seq_len
        self.num_windows = split.num_windows(seq_len)
        if self.num_windows == 0:
            where = f"the {split.name} split of {split.path}" if split.path else f"the {split.name or 'data'} split"
            raise LowbitError(
                f"{where} has {split.num_tokens} tokens, fewer than one window of seq_len+1={seq_len + 1}; "
                "lower data.seq_len or add data"
            )
        if global_batch < 1 or dp_size < 1 or global_batch % dp_size:
            raise LowbitError(
                f"global batch size {global_batch} must be a positive multiple of the data-parallel size {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.global_batch = global_batch
        self.seed = seed
        self.local_batch = global_batch // dp_size
        self.offset = dp_rank * self.local_batch
        self._perms: dict[int, np.ndarray] = {}

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), int64 of shape [global_batch // dp_size, seq_len]; targets are inputs shifted by one."""
        first = step * self.global_batch + self.offset
        positions = np.arange(first, first + self.local_batch, dtype=np.int64)
        epochs, slots = np.divmod(positions, self.num_windows)
        windows = np.empty((self.local_batch, self.seq_len + 1), dtype=np.int64)
        for row, (e, j) in enumerate(zip(epochs.tolist(), slots.tolist())):
            windows[row] = self.split.window(int(self._perm(e)[j]), self.seq_len)
        w = torch.from_numpy(windows)
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def position(self, step: int) -> dict:
        """What a checkpoint after `step` steps records of the data: the step is the whole position."""
        return {"batch": step, "seed": self.seed, "epoch": self.epoch_of(step)}

    def seek(self, position: dict) -> None:
        """Nothing to do: batch(step) needs no state (StreamLoader's counterpart does)."""

    def epoch_of(self, step: int) -> float:
        """Epochs consumed before batch `step` (so int() of it is the epoch the batch starts in)."""
        return step * self.global_batch / self.num_windows

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch needs at most two epochs: the current and the next
                self._perms.pop(min(self._perms))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.num_windows, generator=g).numpy()
        return self._perms[epoch]


def val_batches(
    split: TokenSplit, seq_len: int, batch: int, max_batches: int | None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """max_batches*batch windows spread evenly over the split, in order (all of them for None), in batches of
    `batch`; the last batch may be smaller. Empty when the split has no full window. Spread, not the first
    ones: the loss is then measured over every held-out document, not over the few that come first."""
    total = split.num_windows(seq_len)
    n = total if max_batches is None else min(total, max(0, max_batches) * batch)
    picked = (np.arange(n, dtype=np.int64) * total) // max(n, 1)  # strictly increasing: n <= total
    out = []
    for start in range(0, n, batch):
        w = torch.from_numpy(np.stack([split.window(int(i), seq_len) for i in picked[start:start + batch]]))
        out.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return out
