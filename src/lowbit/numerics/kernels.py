"""Triton kernels for the eager GPU path of one-scale-per-tensor FP8 casts: amax in one read, the cast in one
read and one write, `quantize` (amax, scale, cast) in three launches, and `cast_transpose`: the cast written row-major
and transposed in one read (the copies a linear's fprop and its backward's GEMMs take), optionally with the amax of
what it read (for a delayed scale's history), registered as the custom op `lowbit::cast_transpose` so that a graph
torch.compile traces keeps it as one call; off in the linears (FUSED_TRANSPOSE).

torch's eager ops take several passes for what these do in one: `x.abs().amax()` writes |x| out before reducing
it, and `(x.float() * scale).clamp(...).to(fp8)` writes fp32 twice. Under torch.compile inductor fuses the same
math into its own kernels (and with the ops around them), so these run only outside it (`usable`). Their results
are meant to be bit for bit those of the torch formulas in scaling.py and qtensor.py (tests/test_gpu.py compares
them; cast_transpose's transposed bytes failed that on an H100); a CPU without Triton never reaches them.
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
# Launch settings, module globals so that benchmarks/quantize_sweep.py can try others. AMAX_PER_SM: the amax pass's
# programs per SM, each walking blocks of AMAX_BLOCK in a grid-stride loop (one atomic pair per program). REVERSE:
# the cast walks the tensor from its end, where the amax pass read last, so the part of x still in L2 (up to ~50 MB
# on a Hopper) is read from there instead of from HBM; the result does not depend on the order.
AMAX_BLOCK, AMAX_PER_SM, AMAX_WARPS, CAST_BLOCK, CAST_WARPS, REVERSE = 4096, 8, 8, 4096, 8, True


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels apply to `x`: a plain tensor (not the fake or functional ones torch.compile traces
    with, also where `is_compiling()` is false: an autograd Function's backward traced by AOTAutograd), on a
    CUDA device with Triton and FP8 (compute capability 8.9 on), contiguous, non-empty."""
    # is_compiling first: dynamo then folds the whole test to False without looking at x (asked about x, it
    # could not trace an autograd.Function's forward and ran it outside autocast: the q/k/v outputs came out fp32)
    return (not torch.compiler.is_compiling() and ENABLED and triton is not None
            and type(x) in (torch.Tensor, torch.nn.Parameter) and x.is_cuda and x.is_contiguous() and x.numel() > 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and _has_fp8(x.device.index))


@functools.cache
def sms(index: int | None) -> int:
    """The GPU's streaming multiprocessors (a grid-stride kernel's grid is a few programs per SM)."""
    return torch.cuda.get_device_properties(index if index is not None else 0).multi_processor_count


def grid_stride(device: torch.device, work: int, per_sm: int) -> int:
    """Programs for `work` blocks or rows walked in a grid-stride loop: at most `per_sm` per SM, so that each program
    sums its share of a reduction and adds it to the total by one atomic."""
    return max(1, min(work, per_sm * sms(device.index)))


@functools.lru_cache
def _has_fp8(index: int | None) -> bool:
    """Triton casts to E4M3 from compute capability 8.9 (Ada, Hopper) on; older GPUs keep the torch formulas."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


if triton is not None:

    @triton.jit
    def _amax_kernel(x_ptr, stats_ptr, n, BLOCK: tl.constexpr):
        # stats: [max |x|, 1 if any NaN], both reduced by atomic max (>= 0); with a NaN, stats[0] is only a max
        # of some values (callers read it only without). BLOCK-element blocks strided over the grid
        # (grid_stride); per element one max.NaN of |x| (a lane that meets a NaN stays NaN).
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = tl.cast(i, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
            acc = tl.maximum(acc, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
        nan = acc != acc
        tl.atomic_max(stats_ptr, tl.max(tl.where(nan, 0.0, acc), axis=0))
        tl.atomic_max(stats_ptr + 1, tl.max(nan.to(tl.float32), axis=0))

    @triton.jit
    def _saturate(y, FMT_MAX: tl.constexpr):
        # clamp to ±FMT_MAX, NaN kept, by min and max: not tl.clamp(propagate_nan=ALL), suspect since the transposed
        # copies went wrong (FUSED_TRANSPOSE)
        return tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX))

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
        y = _saturate(y, FMT_MAX)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _cast_transpose_kernel(x_ptr, y_ptr, yt_ptr, scale_ptr, stats_ptr, M, N, FMT_MAX: tl.constexpr,
                               AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # One [BM, BN] tile of x [M, N]: y = fp8(clamp(x * scale)) as _cast_kernel, stored at [m, n] of y and at
        # [n, m] of yt (the compiler stages the transposed store through shared memory so both stores coalesce).
        # AMAX: the tile's max |x| over its non-NaN values and NaN flag into stats by atomic max.
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        x = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        if AMAX:
            tl.atomic_max(stats_ptr, tl.max(tl.max(tl.where(x != x, 0.0, tl.abs(x)), axis=1), axis=0))
            tl.atomic_max(stats_ptr + 1, tl.max(tl.max(tl.where(x != x, 1.0, 0.0), axis=1), axis=0))
        y = _saturate(x * tl.load(scale_ptr), FMT_MAX)
        y = y.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=mask)
        tl.store(yt_ptr + rn[None, :] * M + rm[:, None], y, mask=mask)


def _stats(x: torch.Tensor) -> torch.Tensor:
    stats = torch.zeros(2, device=x.device, dtype=torch.float32)
    n = x.numel()
    with torch.cuda.device(x.device):  # Triton launches on the current device's stream
        _amax_kernel[(grid_stride(x.device, triton.cdiv(n, AMAX_BLOCK), AMAX_PER_SM),)](
            x, stats, n, BLOCK=AMAX_BLOCK, num_warps=AMAX_WARPS)
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


# Tile of cast_transpose: 128 x 128 elements, 8 warps (a bf16 read of 32 KiB, two FP8 writes of 16 KiB, each row of
# the transposed write 128 contiguous bytes; few enough programs that the amax's two atomics per program do not
# queue). Module globals: `lowbit bench kernels` times other tiles on a GPU.
CT_BLOCK_M, CT_BLOCK_N, CT_WARPS = 128, 128, 8
# Whether qtensor.cast_transpose runs _cast_transpose_kernel (one pass) or `cast` and torch's copy of the transposed
# bytes. Off: on an H100 its transposed copies of fp32 tensors held NaN bytes (docs/numerics.md); on again once its
# GPU tests pass, repeated.
FUSED_TRANSPOSE = False
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@torch.library.custom_op("lowbit::cast_transpose", mutates_args=(), device_types="cuda")
def cast_transpose(x: torch.Tensor, scale: torch.Tensor, e5m2: bool, with_amax: bool) -> tuple[torch.Tensor,
                                                                                                torch.Tensor,
                                                                                                torch.Tensor]:
    """x [M, N] (contiguous, on a GPU where `usable`) * scale (0-d fp32) cast to E4M3 (or E5M2): (y [M, N], yᵀ
    [N, M], amax), y and yᵀ each as `cast` writes it, amax max |x| (NaN if x holds one) when `with_amax`, else 0."""
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    x = x.contiguous()
    M, N = x.shape
    y = torch.empty((M, N), device=x.device, dtype=dtype)
    yt = torch.empty((N, M), device=x.device, dtype=dtype)
    stats = torch.zeros(2, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, CT_BLOCK_M), triton.cdiv(N, CT_BLOCK_N))
    with torch.cuda.device(x.device):
        _cast_transpose_kernel[grid](x, y, yt, scale.float().reshape(1), stats, M, N, FMT_MAX=FP8_MAX[dtype],
                                     AMAX=with_amax, BM=CT_BLOCK_M, BN=CT_BLOCK_N, num_warps=CT_WARPS,
                                     enable_fp_fusion=False)
    return y, yt, torch.where(stats[1] > 0, torch.nan, stats[0])


@cast_transpose.register_kernel("cpu")
def _(x, scale, e5m2, with_amax):
    # the torch formulas of qtensor.cast and scaling.group_amax: a reference to test the op's callers against
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    y = (x.float() * scale.float()).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    amax = x.abs().amax().float() if with_amax else torch.zeros((), dtype=torch.float32)
    return y, y.t().contiguous(), amax


@cast_transpose.register_fake
def _(x, scale, e5m2, with_amax):
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    M, N = x.shape
    return (x.new_empty((M, N), dtype=dtype), x.new_empty((N, M), dtype=dtype),
            x.new_empty((), dtype=torch.float32))
