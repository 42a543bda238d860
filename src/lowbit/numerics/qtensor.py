"""QTensor: quantized data + the scale_inv of each scaling group + how it was scaled.

`data` is a torch float8 tensor: E4M3/E5M2 as such (what `torch._scaled_mm` takes), and formats torch has no
dtype for (FP4, FP6) as E4M3 bytes holding their grid values, all of which E4M3 represents exactly. Dequantized value = data * scale_inv (broadcast over groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowbit.numerics import kernels
from lowbit.numerics.scaling import Scaling, expand_groups, group_amax, scale_from_amax
from lowbit.numerics.scaling_state import ScalingState


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class QTensor:
    data: torch.Tensor
    scale_inv: torch.Tensor  # group layout of scaling.group_amax: [], [M, 1], [1, K] or [M/r, K/c]
    spec: Scaling

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * expand_groups(self.scale_inv, self.spec, self.data.shape)).to(dtype)

    def t(self) -> QTensor:
        """The transpose, as a contiguous copy of the (1-byte) data. Only tensor-granularity scales survive a
        transpose unchanged; other granularities must be re-quantized along the new reduction dimension."""
        if self.spec.granularity != "tensor":
            raise ValueError(f"{self.spec.granularity} scales do not transpose; re-quantize instead")
        return QTensor(self.data.t().contiguous(), self.scale_inv, self.spec)


def _on_triton(x: torch.Tensor, s: Scaling) -> bool:
    """One scale per tensor, an FP8 format, and x where lowbit's Triton kernels run (eager, on a GPU)."""
    return s.granularity == "tensor" and s.format.torch_dtype in FP8 and kernels.usable(x)


def cast(x: torch.Tensor, scale: torch.Tensor, s: Scaling, stochastic: bool = False,
         generator: torch.Generator | None = None) -> torch.Tensor:
    """x * scale onto the format's grid: round to nearest even (or stochastically), saturating at ±max."""
    fmt = s.format
    if _on_triton(x, s) and not stochastic and scale.device == x.device:
        return kernels.cast(x, scale, fmt.max, fmt.torch_dtype)  # eager on a GPU: one pass
    # Row-major data whatever the layout of x (a transposed view in backward): `_scaled_mm` needs it so.
    y = (x.float() * expand_groups(scale, s, x.shape)).contiguous()
    if fmt.torch_dtype is not None and not stochastic:
        # torch's float8 casts round to nearest even; clamping first makes them saturate (NaN stays NaN)
        return y.clamp(-fmt.max, fmt.max).to(fmt.torch_dtype)
    q = fmt.quantize(y, stochastic=stochastic, generator=generator)
    # FP4/FP6 grids are subsets of E4M3: stored as E4M3 bytes, exactly, which is what an FP8 tensor core takes
    return q.to(fmt.torch_dtype or torch.float8_e4m3fn)


def quantize(x: torch.Tensor, s: Scaling, state: ScalingState | None = None, update: bool = False,
             scale: torch.Tensor | None = None) -> QTensor:
    """Quantize a 2-D tensor (last dimension = the GEMM's reduction dimension) with `scale` if given, else with
    the scale its `state`'s strategy picks (recording this amax when `update`), else by current scaling."""
    # eager on a GPU, the current scale (no margin, no power-of-two rounding) and the cast in three launches
    if scale is None and state is None and not s.margin and not s.power_of_two and _on_triton(x, s):
        data, scale_inv = kernels.quantize(x, s.format.max, s.format.torch_dtype)
        return QTensor(data, scale_inv, s)
    if scale is None:
        scale = state.scales_for(x, update) if state is not None else scale_from_amax(group_amax(x, s), s)[0]
    return QTensor(cast(x, scale, s), scale.reciprocal(), s)


def transpose_fused(x: torch.Tensor, s: Scaling) -> bool:
    """Whether `cast_transpose` of this 2-D `x` runs as one Triton pass (eager on a GPU, one FP8 scale per tensor,
    where kernels.FUSED_TRANSPOSE: off, see there); elsewhere it is the cast and a copy of the transposed bytes."""
    return x.dim() == 2 and kernels.FUSED_TRANSPOSE and _on_triton(x, s)


def cast_transpose(x: torch.Tensor, s: Scaling, scale: torch.Tensor) -> tuple[QTensor, QTensor]:
    """x [M, K] cast with one `scale` for the tensor, and the same bytes transposed ([K, M], row-major): what a
    backward GEMM takes. One pass over x where `transpose_fused`, else `cast` then `QTensor.t`: the same bytes."""
    if transpose_fused(x, s) and scale.device == x.device:
        y, yt, _ = torch.ops.lowbit.cast_transpose(x, scale, s.format.torch_dtype == torch.float8_e5m2, False)
        inv = scale.reciprocal()
        return QTensor(y, inv, s), QTensor(yt, inv, s)
    q = QTensor(cast(x, scale, s), scale.reciprocal(), s)
    return q, q.t()
