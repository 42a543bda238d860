"""FP8-LM's gradient scaling for a sum of FP8 gradients (the data-parallel all-reduce).

N gradients are summed in FP8 under one shared per-tensor scale: the global minimum of the N scales, i.e. the
scale of the global amax (an all-reduce MAX of amaxes). The scale fits each gradient, not their sum, so:

    pre   divide each gradient by N before casting: the sum cannot overflow, small values underflow sooner
    post  cast, sum, divide by N afterwards: no extra underflow, the sum may overflow (saturate)
    auto  multiply by mu before casting and divide by mu*N afterwards; mu halves when the fraction of summed
          values that overflow exceeds a threshold (default 0.001%) and doubles after a window of clean steps

`fp8_sum` is the exact function of such a reduction in rank order (each partial sum rounded to the format, as an
FP8 ring reduction does). Nothing in training calls it yet: a single process has no ranks to reduce over; it is
the reference the distributed gradient sync (to come) will be built and tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.numerics.formats import get_format
from lowbit.optim.precision import pow2_scale

MODES = ("pre", "post", "auto")


@dataclass
class AutoScale:
    """The automatic scaling factor mu, between 1/N (pre-scaling) and 1 (post-scaling)."""

    world: int
    threshold: float = 1e-5  # 0.001% of values overflowing
    window: int = 1000  # clean steps before mu doubles
    mu: float = 1.0
    clean: int = 0
    halvings: int = 0

    def __post_init__(self):
        if self.world < 1 or self.window < 1 or not 0 <= self.threshold < 1:
            raise LowbitError(f"grad scaling: world >= 1, window >= 1, threshold in [0, 1) (got {self.world}, "
                              f"{self.window}, {self.threshold})")

    def update(self, overflow_ratio: float) -> None:
        if overflow_ratio > self.threshold:
            self.mu, self.clean = max(self.mu / 2, 1.0 / self.world), 0
            self.halvings += 1
        else:
            self.clean += 1
            if self.clean >= self.window:
                self.mu, self.clean = min(self.mu * 2, 1.0), 0

    def state_dict(self) -> dict:
        return {"mu": self.mu, "clean": self.clean, "halvings": self.halvings}

    def load_state_dict(self, state: dict) -> None:
        self.mu, self.clean, self.halvings = float(state["mu"]), int(state["clean"]), int(state["halvings"])


def fp8_sum(parts: list[torch.Tensor], mode: str = "auto", fmt: str = "e4m3", mu: float = 1.0
            ) -> tuple[torch.Tensor, float]:
    """The mean of `parts` as an FP8 reduction computes it: returns (mean in fp32, fraction of overflowed values).
    `mu` is used by mode `auto`."""
    if mode not in MODES:
        raise LowbitError(f"grad scaling mode {mode!r} is not one of {', '.join(MODES)}")
    if not parts:
        raise LowbitError("fp8_sum: nothing to sum")
    f = get_format(fmt)
    n = len(parts)
    factor = {"pre": 1.0 / n, "post": 1.0, "auto": mu}[mode]
    amax = torch.stack([p.detach().abs().amax().float() for p in parts]).amax()
    scale = pow2_scale(amax, f.max, torch.ones((), device=amax.device))  # shared: the global minimum scale

    def cast(x):
        return x.clamp(-f.max, f.max).to(f.torch_dtype).float()

    acc = cast(parts[0].float() * (factor * scale))
    overflow = torch.zeros(acc.shape, dtype=torch.bool, device=acc.device)
    for p in parts[1:]:
        s = acc + cast(p.float() * (factor * scale))
        overflow |= s.abs() > f.max
        acc = cast(s)
    return acc / (scale * factor * n), overflow.float().mean().item()
