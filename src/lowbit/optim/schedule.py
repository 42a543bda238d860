"""Learning-rate schedule: linear warm-up, then cosine decay to a floor (the LLaMA schedule)."""

from __future__ import annotations

import math


def lr_lambda(steps: int, warmup: int, min_ratio: float):
    """Multiplier of the peak LR after `i` scheduler steps: linear warm-up, then cosine down to min_ratio."""

    def f(i: int) -> float:
        if i < warmup:
            return (i + 1) / warmup
        progress = min(1.0, (i - warmup) / max(1, steps - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f
