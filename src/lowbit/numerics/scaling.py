"""How a scale is chosen, as a spec (`Scaling`) and stateless math: granularity (which elements share a scale) x
strategy (whose amax sets it). The state a delayed scale is kept in, and the recording of casts, is `scaling_state`.

Every operand is seen as a 2-D matrix whose last dimension is the GEMM's reduction dimension (lowbit's GEMMs are
`A @ Bᵀ` with A [M, K] and B [N, K]). Granularities:

    tensor   one scale for the whole matrix
    row      one scale per row: per token for activations, per output channel for weights (what `_scaled_mm`
             calls rowwise); constant along the reduction dimension, so the GEMM can apply it afterwards
    column   one scale per column (per input channel): varies along the reduction dimension, emulated only
    block    one scale per (rows x cols) tile, e.g. (1, 128) activations and (128, 128) weights (DeepSeek-V3)
    mx       one E8M0 (power-of-two) scale per 32 consecutive elements along the reduction dimension (OCP MX)

Strategies: `current` uses the amax of the tensor being cast; `delayed` uses an amax history of past steps
(tensor granularity only): TransformerEngine's rolling window (`interval=1`: the scale is recomputed every step
from the window) and nanotron's interval semantics (`interval=N`: recomputed once every N steps). The first cast,
with no history yet, uses its own amax; with `warmup=N` (MS-AMP's), every cast does while fewer than N good
amaxes lead the window: the first N steps, and the N after a non-finite (or zero) amax.

scale = 2^-margin * fmt.max / amax, optionally rounded down to a power of two; `q = cast(x * scale)`.
An amax that is 0, NaN or Inf is counted. A delayed scale then keeps the previous one. A current scale of an input
or a weight is then 1: it depends on the tensor alone, so linears that read one input (q, k, v) cast it
identically and torch.compile merges their casts and saved copies. (The output gradient's current cast, in
backward, keeps the previous scale, tensor granularity: no two linears share a gradient.)
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch
from torch import nn

from lowbit.numerics import kernels
from lowbit.errors import LowbitError
from lowbit.numerics.formats import get_format

GRANULARITIES = ("tensor", "row", "column", "block", "mx")
STRATEGIES = ("current", "delayed")
MX_BLOCK = 32


@dataclass(frozen=True)
class Scaling:
    """How one GEMM operand is quantized."""

    fmt: str = "e4m3"
    granularity: str = "tensor"
    block: tuple[int, int] = (1, 128)  # `block` only: (rows, cols), cols along the reduction dimension
    strategy: str = "current"
    history: int = 16  # delayed: amax history length
    algo: str = "max"  # delayed: max | most_recent
    interval: int = 1  # delayed: recompute the scale every `interval` updates
    warmup: int = 0  # delayed: cast with the current amax while a bad or missing one is among the last `warmup`
    margin: int = 0
    pow2: bool = False  # round scales down to powers of two (exact dequantization)

    def __post_init__(self):
        fmt = get_format(self.fmt)
        if fmt.name == "e8m0":
            raise LowbitError("scaling: e8m0 holds scales, not data; pick e4m3, e5m2, e2m1, e3m2 or e2m3")
        if self.granularity not in GRANULARITIES:
            raise LowbitError(f"scaling granularity {self.granularity!r} is not one of {', '.join(GRANULARITIES)}")
        if self.strategy not in STRATEGIES:
            raise LowbitError(f"scaling strategy {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.strategy == "delayed" and self.granularity != "tensor":
            raise LowbitError(f"delayed scaling needs tensor granularity, not {self.granularity!r}: a history of "
                              "per-row or per-block amaxes has no meaning when rows are different tokens each step")
        if self.algo not in ("max", "most_recent"):
            raise LowbitError(f"delayed scaling algo {self.algo!r} is not one of max, most_recent")
        if self.history < 1 or self.interval < 1 or self.warmup < 0:
            raise LowbitError("delayed scaling: history and interval must be >= 1, warmup >= 0")
        if self.granularity == "block" and (len(self.block) != 2 or min(self.block) < 1):
            raise LowbitError(f"block scaling: block must be two positive sizes, got {self.block}")

    @property
    def format(self):
        return get_format(self.fmt)

    @property
    def group(self) -> tuple[int, int] | None:
        """(rows, cols) of the tile sharing one scale; None for the whole tensor."""
        return {"tensor": None, "row": (1, None), "column": (None, 1), "block": self.block,
                "mx": (1, MX_BLOCK)}[self.granularity]

    @property
    def power_of_two(self) -> bool:
        return self.pow2 or self.granularity == "mx"


def group_amax(x: torch.Tensor, s: Scaling) -> torch.Tensor:
    """amax of each scaling group of a 2-D tensor, shaped to broadcast against the *padded* tiles:
    [] (tensor), [M, 1] (row), [1, K] (column), [ceil(M/r), ceil(K/c)] (block, mx)."""
    g = s.granularity
    if g == "tensor" and kernels.usable(x):  # eager on a GPU: one read of x
        return kernels.amax(x.detach())
    a = x.detach().abs()  # a max is one of its inputs, exact in x's dtype: fp32 only after the reduction
    if g == "tensor":
        return a.amax().float()
    if g == "row":
        return a.amax(dim=-1, keepdim=True).float()
    if g == "column":
        return a.amax(dim=0, keepdim=True).float()
    r, c = s.group
    M, K = a.shape
    pad = (0, (-K) % c, 0, (-M) % r)
    a = nn.functional.pad(a, pad)  # zeros do not change an amax
    return a.view(a.shape[0] // r, r, a.shape[1] // c, c).amax(dim=(1, 3)).float()


def all_max(amax: torch.Tensor, group) -> torch.Tensor:
    """The MAX of `amax` over a process group: the shards of one tensor (tensor parallelism) share the scale of
    the whole."""
    import torch.distributed as dist

    amax = amax.clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def expand_groups(t: torch.Tensor, s: Scaling, shape: torch.Size) -> torch.Tensor:
    """Broadcast per-group values (from group_amax's layout) to the full [M, K] shape."""
    if s.granularity in ("tensor", "row", "column"):
        return t.expand(shape)
    r, c = s.group
    gm, gk = t.shape
    full = t[:, None, :, None].expand(gm, r, gk, c).reshape(gm * r, gk * c)  # one copy, no repeat_interleave
    return full[: shape[0], : shape[1]]


def is_bad(amax: torch.Tensor) -> torch.Tensor:
    # amax > 0 is false for NaN too: two comparisons cover 0, NaN and ±Inf (this runs for every cast, eagerly a
    # kernel per op, so the op count matters)
    return ~((amax > 0) & (amax < math.inf))


def scale_from_amax(amax: torch.Tensor, s: Scaling, fallback: torch.Tensor | float = 1.0) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(scale, bad) where bad marks groups whose amax was 0, NaN or Inf and that kept `fallback`."""
    fmt = s.format
    bad = is_bad(amax)
    scale = fmt.max / amax  # inf or NaN where bad: replaced by the fallback at the end
    if s.margin:
        scale = scale * 2.0 ** (-s.margin)
    if s.power_of_two:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    # fp32 scale can overflow to inf for tiny amax (e.g. 1e-40): clamp into the finite range
    scale = scale.clamp(max=torch.finfo(torch.float32).max)
    return torch.where(bad, fallback, scale), bad


def current_scale(x: torch.Tensor, s: Scaling, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling of `x`: (scale, amax, bad), from `x` alone (and the shards of it in `group`), in one
    reduction over `x`. A group with a bad amax (0, NaN, Inf) is cast with scale 1: Inf saturates to ±max, NaN
    stays NaN. No state is read, so two linears fed one tensor compute the same cast, which torch.compile's
    common-subexpression pass then does once (and saves once for backward)."""
    amax = group_amax(x, s)
    if group is not None:
        amax = all_max(amax, group)
    scale, bad = scale_from_amax(amax, s)
    return scale, amax, bad
