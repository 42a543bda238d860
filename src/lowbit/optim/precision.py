"""Where each optimizer state is stored (FP8-LM's precision decoupling) and how a tensor is stored there.

Every kind is held as `data` plus a per-tensor power-of-two `scale` (dequantized value = data / scale). Unscaled
kinds (fp32, bf16) keep scale 1. Scaled kinds put the tensor's amax at the top of the format's range, so a
second moment (gradient squared: twice the gradient's dynamic range in binades) keeps its small entries: fp16
then spans 2^-24..2^16 times the scale, E4M3 only 2^-9..2^8.5.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from lowbit.errors import LowbitError

# kind -> (storage dtype, scaled, largest finite value)
KINDS = {
    "fp32": (torch.float32, False, torch.finfo(torch.float32).max),
    "bf16": (torch.bfloat16, False, torch.finfo(torch.bfloat16).max),
    "fp16": (torch.float16, True, 65504.0),
    "e4m3": (torch.float8_e4m3fn, True, 448.0),
    "e5m2": (torch.float8_e5m2, True, 57344.0),
}
ALLOWED = {
    "weights": ("fp32", "bf16"),
    "master": ("none", "fp32", "bf16", "fp16"),
    "grads": ("fp32", "bf16", "e4m3", "e5m2"),
    "exp_avg": ("fp32", "bf16", "e4m3"),
    "exp_avg_sq": ("fp32", "bf16", "fp16", "e4m3", "e5m2"),
}


@dataclass(frozen=True)
class StatePrecision:
    """Storage of one parameter and its optimizer states. Update math is always fp32.

    weights: the parameter the model computes with. master: a separate copy the update is applied to (`none`:
    the weights are the master). grads: what a gradient is kept in between backward and the step."""

    weights: str = "fp32"
    master: str = "none"
    grads: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"

    def __post_init__(self):
        for key, allowed in ALLOWED.items():
            if getattr(self, key) not in allowed:
                raise LowbitError(f"optim.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.grads == "fp32" and self.weights != "fp32":
            raise LowbitError(f"optim.grads: fp32 gradients need fp32 weights (autograd delivers gradients in the "
                              f"weights' dtype, {self.weights})")
        if self.master == self.weights:
            raise LowbitError(f"optim.master: a {self.master} master copy of {self.weights} weights is the weights "
                              f"again; use master = \"none\"")

    @property
    def all_fp32(self) -> bool:
        return self == StatePrecision()

    def bytes_per_param(self) -> dict[str, float]:
        """The theoretical figure: bytes per parameter by category (per-tensor scales left out)."""
        size = {k: 0 if v == "none" else KINDS[v][0].itemsize for k, v in asdict(self).items()}
        return {**size, "total": sum(size.values())}


def fp32_default() -> StatePrecision:
    return StatePrecision()


def _pow2_scale(amax: torch.Tensor, fmax: float, old: torch.Tensor) -> torch.Tensor:
    """The largest power of two s with amax * s <= fmax; the old scale when amax is 0, NaN or Inf (1 if the old
    one is not a usable scale either)."""
    a = amax.float()
    old = torch.where(torch.isfinite(old) & (old > 0), old, torch.ones_like(old))
    good = torch.isfinite(a) & (a > 0)
    safe = torch.where(good, a, torch.ones_like(a))
    s = torch.exp2(torch.floor(torch.log2(fmax / safe)).clamp(-126, 126))
    s = torch.where(safe * s > fmax, s * 0.5, s)  # log2 rounding at exact powers of two
    return torch.where(good, s, old)


def encode(x: torch.Tensor, kind: str, scale: torch.Tensor, out: torch.Tensor | None = None,
           amax: torch.Tensor | None = None) -> torch.Tensor:
    """Store `x` as `kind` (into `out` if given); updates the per-tensor `scale` in place for scaled kinds (from
    `amax` if the caller has it). Returns the stored data."""
    dtype, scaled, fmax = KINDS[kind]
    if scaled:
        scale.copy_(_pow2_scale(x.abs().amax() if amax is None else amax, fmax, scale))
        data = (x * scale).clamp_(-fmax, fmax).to(dtype)
    else:
        data = x.to(dtype)
    if out is None:
        return data
    out.copy_(data)
    return out


def decode(data: torch.Tensor, kind: str, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of stored data."""
    x = data.float()
    return x / scale if KINDS[kind][1] else x
