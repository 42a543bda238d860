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
token's scale; the residual ΔY = Y − clamp(Y) (about (1 − α)·numel non-zeros) is kept unquantized as (index,
value) pairs, and ΔY·Wᵀ is added to the output (and ΔYᵀ·dY to the weight gradient), see `OCC.products`.

So that torch.compile traces OCC without a graph break, everything has a static shape: the outliers are found by
nonzero_static, the sparse products are custom ops; the residual is C (flat index, fp32 value) pairs,
C = max(1, ⌈2·(1 − α)·numel⌉) (twice the expected count: the sampled quantile is approximate), unused slots holding
value 0. Overflow: if more than C elements exceed the quantile, the clamp threshold is raised, by powers of
two, until at most C exceed it (at worst to max |x|, which clamps nothing); the split stays exact: clamp(x) + ΔY = x.
Nothing here waits for the GPU: a count read on the host would stall every FP4 linear's forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError
from lowbit.numerics.gemm import scaled_matmul
from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling

QUANTILE_SAMPLE = 1 << 16  # elements the sampled quantile looks at
PRODUCTS = ("dense", "fp8", "sparse")  # OCC.products


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
    quantile: str = "sample"  # exact (a selection over every element) | sample (over whole, evenly spaced tokens)
    # How ΔY·Wᵀ and ΔYᵀ·dY are computed. dense: ΔY as a dense matrix (zeros but for the outliers) in the GEMM's
    # compute dtype (bf16 under autocast, as the bf16 baseline computes the whole product), two dense GEMMs the
    # size of the layer's, no host sync of their own. fp8: the same dense products as FP8 GEMMs (`occ_fp8_mm`:
    # ΔY and W in E4M3, dy in E5M2, one current scale per tensor), at FP8's speed and 3 bits of mantissa for the
    # residual (still 2 more than E2M1's). sparse: torch.sparse products in fp32 (1/100 of the FLOPs at α =
    # 0.99, but COO SpMM and a host sync each). All keep the residual for backward as the C (index, value) pairs.
    products: str = "dense"

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise LowbitError(f"OCC: alpha must be in (0, 1], got {self.alpha}")
        if self.quantile not in ("exact", "sample"):
            raise LowbitError(f"OCC: quantile {self.quantile!r} is not one of exact, sample")
        if self.products not in PRODUCTS:
            raise LowbitError(f"OCC: products {self.products!r} is not one of {', '.join(PRODUCTS)}")


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
    """The α-quantile of |x| ([tokens, channels]) without sorting: a selection over all elements, or over
    about QUANTILE_SAMPLE elements made of whole, evenly spaced tokens (every channel is seen: outliers live in
    particular channels, which a stride over the flat tensor could miss or over-count)."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    if method == "sample" and x2.numel() > QUANTILE_SAMPLE:
        x2 = x2[:: max(1, x2.shape[0] // max(1, QUANTILE_SAMPLE // x2.shape[1]))]
    a = x2.abs().reshape(-1).float()
    k = min(a.numel(), max(1, int(round(alpha * a.numel()))))
    if a.is_cuda:  # the k-th smallest as the (n − k + 1)-th largest: CUDA's kthvalue runs one thread block per
        a = torch.where(a.isnan(), math.inf, a)  # slice (0.28 ms for 65,536 on an H200); NaN counts as largest,
        return a.topk(a.numel() - k + 1, sorted=False).values.min()  # as kthvalue has it
    return a.kthvalue(k).values


def occ_capacity(numel: int, alpha: float) -> int:
    """C, the number of residual slots for `numel` elements (see the module docstring)."""
    return max(1, math.ceil(2 * (1 - alpha) * numel))


RAISES = 8  # overflow: the clamp threshold tries q·2, q·4, ..., q·2^RAISES, then amax


def occ_outliers(x: torch.Tensor, q: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clamp threshold t, flat indices [C], fp32 residual values [C]) of the elements of x with |x| > t, in index
    order, unused slots index 0 and value 0. t is q unless more than C elements exceed it; then the first of q·2,
    q·4, ..., q·2^RAISES, amax that at most C exceed. Static shapes and no host sync: the counts are one fused
    reduction under torch.compile, nonzero_static fills the slots."""
    a = x.detach().abs().reshape(-1)
    cand = torch.cat([q.reshape(1) * 2.0 ** torch.arange(RAISES + 1, device=a.device), a.max().reshape(1)]).to(a.dtype)
    counts = torch.stack([(a > t).sum() for t in cand.unbind()])  # the last (amax) is 0: one always fits
    first = (counts <= capacity).int().argmax().reshape(1)  # indexed by gather: a tensor index would sync
    t, n = cand.gather(0, first)[0], counts.gather(0, first)[0]
    idx = torch.nonzero_static(a > t, size=capacity, fill_value=0).squeeze(1)
    xs = x.reshape(-1)[idx]
    val = xs.float() - xs.clamp(-t, t).float()  # the outliers in fp32, whatever x's dtype
    val = torch.where(torch.arange(capacity, device=a.device) < n, val, 0.0)  # unused slots contribute nothing
    return t, idx, val


def occ_split(x: torch.Tensor, occ: OCC) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(clamped x, residual indices, residual values) of a 2-D x, α < 1. The clamp stays in the traced graph
    (torch.compile fuses it with the quantization); the residual is what `occ_residual` turns into a matrix."""
    q = abs_quantile(x, occ.alpha, occ.quantile).to(x.dtype)
    t, idx, val = occ_outliers(x, q, occ_capacity(x.numel(), occ.alpha))
    return x.clamp(-t, t), idx, val


def occ_residual(idx: torch.Tensor, val: torch.Tensor, shape) -> torch.Tensor:
    """The residual ΔY as a sparse COO matrix of `shape`, unused slots dropped. Indices come sorted and unique,
    so it is built coalesced (no sort)."""
    keep = val.nonzero().squeeze(1)
    idx, val = idx[keep], val[keep]
    return torch.sparse_coo_tensor(torch.stack([idx // shape[1], idx % shape[1]]), val, tuple(shape),
                                   is_coalesced=True, check_invariants=False)


def occ_dense(idx: torch.Tensor, val: torch.Tensor, shape, dtype: torch.dtype) -> torch.Tensor:
    """ΔY as a dense matrix of `shape` in `dtype`: the residual values written into zeros. The outliers' indices
    are unique; the unused slots (value 0) write to one spare element past the end, so no write races with a
    real one and nothing needs atomics. Static shapes, no host sync."""
    n = shape[0] * shape[1]
    flat = torch.zeros(n + 1, dtype=dtype, device=val.device)
    flat.index_put_((torch.where(val != 0, idx, n),), val.to(dtype))
    return flat[:n].view(shape[0], shape[1])


def occ_fp8_mm(a: torch.Tensor, b: torch.Tensor, a_fmt: str = "e4m3") -> torch.Tensor:
    """a [M, K] @ b [N, K]ᵀ in fp32 as one FP8 GEMM: a in `a_fmt` (E5M2 for a gradient), b in E4M3, each with one
    current scale per tensor (OCC's compensation products with `products = "fp8"`)."""
    return scaled_matmul(quantize(a, Scaling(a_fmt)), quantize(b, Scaling("e4m3")), torch.float32)


@torch.library.custom_op("lowbit::occ_mm", mutates_args=())
def occ_mm(idx: torch.Tensor, val: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """ΔY·Wᵀ [rows, out] for an fp32 W: the forward's compensation (Wᵀ made contiguous: the CPU kernel reads its
    rows, about 2x faster than through W's strides)."""
    return torch.sparse.mm(occ_residual(idx, val, (rows, weight.shape[1])), weight.t().contiguous())


@occ_mm.register_fake
def _(idx, val, weight, rows):
    return val.new_empty(rows, weight.shape[0])


@torch.library.custom_op("lowbit::occ_wgrad", mutates_args=())
def occ_wgrad(idx: torch.Tensor, val: torch.Tensor, dy: torch.Tensor, cols: int) -> torch.Tensor:
    """ΔYᵀ·dY [cols, out] in fp32 (the weight gradient's compensation term, transposed)."""
    return torch.sparse.mm(occ_residual(idx, val, (dy.shape[0], cols)).t(), dy.float())


@occ_wgrad.register_fake
def _(idx, val, dy, cols):
    return val.new_empty(cols, dy.shape[1])


def check_fp4_dims(name: str, in_features: int, out_features: int) -> None:
    """Two FP4 values share a byte (and the GEMMs take both dims as reduction dims): both must be even."""
    if in_features % 2 or out_features % 2:
        raise LowbitError(f"FP4 on {name}: {in_features} -> {out_features} features; packed FP4 needs even "
                          f"dimensions (keep the layer in high precision with --numerics.keep or --numerics.min_dim)")
