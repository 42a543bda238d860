"""Triton kernels for the eager GPU path of one-scale-per-tensor FP8 casts: amax in one read, the cast in one
read and one write, and `quantize` (amax, scale, cast) in three launches.

torch's eager ops take several passes for what these do in one: `x.abs().amax()` writes |x| out before reducing
it, and `(x.float() * scale).clamp(...).to(fp8)` writes fp32 twice. Under torch.compile inductor fuses the same
math into its own kernels (and with the ops around them), so these run only outside it (`usable`). Their results
are bit for bit those of the torch formulas in scaling.py and qtensor.py (tests/test_gpu.py compares them); a
CPU without Triton never reaches them.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU install: the torch formulas serve
    triton = None

# LOWBIT_TRITON=0 keeps the torch formulas everywhere (to compare, or to rule the kernels out)
ENABLED = os.environ.get("LOWBIT_TRITON", "1") != "0"
# Launch settings, module globals so that benchmarks/quantize_sweep.py can try others. REVERSE: the cast walks the
# tensor from its end, where the amax pass read last, so the part of x still in L2 (up to ~50 MB on a Hopper) is
# read from there instead of from HBM; the result does not depend on the order.
AMAX_BLOCK, AMAX_ITERS, AMAX_WARPS, CAST_BLOCK, CAST_WARPS, REVERSE = 4096, 16, 8, 4096, 8, True


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels apply to `x`: a plain tensor (not the fake or functional ones torch.compile traces
    with, also where `is_compiling()` is false: an autograd Function's backward traced by AOTAutograd), on a
    CUDA device with Triton and FP8 (compute capability 8.9 on), contiguous, non-empty."""
    # is_compiling first: dynamo then folds the whole test to False without looking at x (asked about x, it
    # could not trace an autograd.Function's forward and ran it outside autocast: the q/k/v outputs came out fp32)
    return (not torch.compiler.is_compiling() and ENABLED and triton is not None
            and type(x) in (torch.Tensor, torch.nn.Parameter) and x.is_cuda and x.is_contiguous() and x.numel() > 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _has_fp8(x.device.index))


@functools.lru_cache
def _has_fp8(index: int | None) -> bool:
    """Triton casts to E4M3 from compute capability 8.9 (Ada, Hopper) on; older GPUs keep the torch formulas."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


if triton is not None:

    @triton.jit
    def _amax_kernel(x_ptr, stats_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        # stats: [max |x| over the finite and infinite values, 1 if any NaN], both reduced by atomic max (>= 0)
        base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.where(x != x, 0.0, tl.abs(x)))
            nan = tl.maximum(nan, tl.where(x != x, 1.0, 0.0))
        tl.atomic_max(stats_ptr, tl.max(acc, axis=0))
        tl.atomic_max(stats_ptr + 1, tl.max(nan, axis=0))

    @triton.jit
    def _cast_kernel(x_ptr, y_ptr, scale_ptr, stats_ptr, scale_inv_ptr, n, FMT_MAX: tl.constexpr,
                     FROM_STATS: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr):
        # y = fp8(clamp(x * scale, ±max)), NaN kept. FROM_STATS: the scale from _amax_kernel's stats as
        # scaling.scale_from_amax makes it (fallback 1; fmt.max / amax, at most fp32's max), and
        # program 0 writes its reciprocal; else the scale is read from scale_ptr.
        pid = tl.program_id(0)
        if FROM_STATS:
            amax = tl.load(stats_ptr)
            bad = (tl.load(stats_ptr + 1) > 0) | (amax <= 0) | (amax > 3.4028234663852886e38)
            one = tl.where(bad, 1.0, amax) * 0.0 + 1.0  # 1.0 as a tensor, for div_rn
            # torch computes `fmt.max / amax` as amax.reciprocal() * fmt.max: two roundings, kept here
            scale = tl.minimum(tl.math.div_rn(one, tl.where(bad, 1.0, amax)) * FMT_MAX, 3.4028234663852886e38)
            scale = tl.where(bad, 1.0, scale)
            if pid == 0:
                tl.store(scale_inv_ptr, tl.math.div_rn(one, scale))
        else:
            scale = tl.load(scale_ptr)
        block = pid
        if REVERSE:
            block = tl.num_programs(0) - 1 - pid
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        y = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX))
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)


def _stats(x: torch.Tensor) -> torch.Tensor:
    stats = torch.zeros(2, device=x.device, dtype=torch.float32)
    n = x.numel()
    with torch.cuda.device(x.device):  # Triton launches on the current device's stream
        _amax_kernel[(triton.cdiv(n, AMAX_BLOCK * AMAX_ITERS),)](x, stats, n, BLOCK=AMAX_BLOCK, ITERS=AMAX_ITERS,
                                                                num_warps=AMAX_WARPS)
    return stats


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor, NaN if x holds one (as `x.abs().amax().float()`)."""
    stats = _stats(x)
    return torch.where(stats[1] > 0, torch.nan, stats[0])


def cast(x: torch.Tensor, scale: torch.Tensor, fmt_max: float, dtype: torch.dtype) -> torch.Tensor:
    """x * scale (`scale` a 0-d fp32 tensor) cast to the float8 `dtype`, round to nearest even, saturating at
    ±fmt_max, NaN kept (as qtensor.cast)."""
    y = torch.empty(x.shape, device=x.device, dtype=dtype)
    n = x.numel()
    with torch.cuda.device(x.device):
        _cast_kernel[(triton.cdiv(n, CAST_BLOCK),)](x, y, scale.float().reshape(1), scale, scale, n,
                                                    FMT_MAX=fmt_max, FROM_STATS=False, BLOCK=CAST_BLOCK,
                                                    REVERSE=False, num_warps=CAST_WARPS)
    return y


def quantize(x: torch.Tensor, fmt_max: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Current scaling of one tensor in three launches: (data, scale_inv), as qtensor.quantize with
    scaling.current_scale (margin 0, scales not rounded to powers of two)."""
    stats = _stats(x)
    y = torch.empty(x.shape, device=x.device, dtype=dtype)
    scale_inv = torch.empty((), device=x.device, dtype=torch.float32)
    n = x.numel()
    with torch.cuda.device(x.device):
        _cast_kernel[(triton.cdiv(n, CAST_BLOCK),)](x, y, stats, stats, scale_inv, n, FMT_MAX=fmt_max,
                                                    FROM_STATS=True, BLOCK=CAST_BLOCK, REVERSE=REVERSE,
                                                    num_warps=CAST_WARPS)
    return y, scale_inv
