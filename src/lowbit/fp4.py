"""FP4 training (Wang et al. 2025): the differentiable gradient estimator (DGE) for weights and outlier clamping
with sparse compensation (OCC) for activations.

DGE. Quantizing a weight is a staircase whose derivative is zero almost everywhere; straight-through (STE)
pretends it is the identity. DGE differentiates a smooth surrogate of one step instead, on the scaled weight x
(|x| <= 6 on the E2M1 grid) with δ the local grid interval (0.5 on [0, 2], 1 on [2, 4], 2 on [4, 6]) and u the
offset of |x| in its interval:

    f(u)  = δ/2 · (1 + sign(2u/δ − 1) · |2u/δ − 1|^(1/k))
    f'(u) = (1/k) · |2u/δ − 1|^(1/k − 1)          clamped at `clamp` (it diverges mid-interval)

k = 1 is the identity (STE); growing k sharpens f towards the hard quantizer. The weight gradient is multiplied
by f'.

OCC. Activations are clamped at the α-quantile of |x| before quantization, so a few outliers no longer stretch the
token's scale; the residual ΔY = Y − clamp(Y) (about (1 − α)·numel non-zeros) stays in high precision as a sparse
matrix, and ΔY·Wᵀ is added to the output (and ΔYᵀ·dY to the weight gradient).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError

QUANTILE_SAMPLE = 1 << 16  # elements the sampled quantile looks at


@dataclass(frozen=True)
class DGE:
    k: float = 5.0
    clamp: float = 3.0

    def __post_init__(self):
        if not self.k > 0:
            raise LowbitError(f"DGE: k must be > 0, got {self.k}")
        if not self.clamp > 0:
            raise LowbitError(f"DGE: clamp must be > 0, got {self.clamp}")


@dataclass(frozen=True)
class OCC:
    alpha: float = 0.99
    quantile: str = "sample"  # exact (kthvalue over every element) | sample (kthvalue over a strided sample)

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise LowbitError(f"OCC: alpha must be in (0, 1], got {self.alpha}")
        if self.quantile not in ("exact", "sample"):
            raise LowbitError(f"OCC: quantile {self.quantile!r} is not one of exact, sample")


def _interval(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(δ, offset of |x| within its interval) on the E2M1 grid 0, .5, 1, 1.5, 2, 3, 4, 6."""
    delta = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    base = torch.where(a < 2, 0.0, torch.where(a < 4, 2.0, 4.0))
    u = a - base
    return delta, u - torch.floor(u / delta) * delta


def dge_surrogate(x: torch.Tensor, k: float) -> torch.Tensor:
    """f applied within each grid interval of the scaled weight x: the smooth stand-in for the quantizer."""
    a = x.abs()
    delta, u = _interval(a)
    t = 2 * u / delta - 1
    return torch.sign(x) * (a - u + delta / 2 * (1 + torch.sign(t) * t.abs() ** (1 / k)))


def dge_factor(x: torch.Tensor, dge: DGE) -> torch.Tensor:
    """f'(x) of the scaled weight x, clamped: what the weight gradient is multiplied by."""
    delta, u = _interval(x.abs())
    t = (2 * u / delta - 1).abs()
    return ((1 / dge.k) * t.pow(1 / dge.k - 1)).clamp(max=dge.clamp)  # t = 0 gives inf, then the clamp


def abs_quantile(x: torch.Tensor, alpha: float, method: str = "sample") -> torch.Tensor:
    """The α-quantile of |x| ([tokens, channels]) without sorting: kthvalue (a selection) over all elements, or over
    about QUANTILE_SAMPLE elements made of whole, evenly spaced tokens (every channel is seen: outliers live in
    particular channels, which a stride over the flat tensor could miss or over-count)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    if method == "sample" and x2.numel() > QUANTILE_SAMPLE:
        x2 = x2[:: max(1, x2.shape[0] // max(1, QUANTILE_SAMPLE // x2.shape[1]))]
    a = x2.abs().reshape(-1).float()
    k = min(a.numel(), max(1, int(round(alpha * a.numel()))))
    return a.kthvalue(k).values


def occ_split(x: torch.Tensor, occ: OCC) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped x, sparse residual x − clamped x). α = 1 clamps nothing."""
    if occ.alpha >= 1:
        return x, torch.zeros_like(x, dtype=torch.float32).to_sparse()
    q = abs_quantile(x, occ.alpha, occ.quantile).to(x.dtype)
    clamped = x.clamp(-q, q)
    return clamped, (x.float() - clamped.float()).to_sparse()  # the outliers in fp32, whatever x's dtype


def check_fp4_dims(name: str, in_features: int, out_features: int) -> None:
    """Two FP4 values share a byte (and the GEMMs take both dims as reduction dims): both must be even."""
    if in_features % 2 or out_features % 2:
        raise LowbitError(f"FP4 on {name}: {in_features} -> {out_features} features; packed FP4 needs even "
                          f"dimensions (keep the layer in high precision with --numerics.min_dim)")
