"""Fused producers: the SwiGLU product silu(a)·b and RMSNorm written directly as FP8 with the scale of the linear
that reads them, with the amax of what they wrote, so that no bf16 activation is written only to be read back and
cast.

The math is the model's, rounding for rounding: silu(a) rounded to a's dtype, times b rounded to b's
(models/llama.py `_SiluMul`, autograd's mul); the norm's rows in fp32, `(x · rstd)` rounded to x's dtype, times the
weight in the weight's dtype (`_RMSNorm`). Then the cast of `qtensor.cast`. So the FP8 bytes are those of the
unfused path (the norm's given the same rstd: a sum over a row in another order may differ in its last bit).

Current scaling needs the amax before the cast: `*_amax` reads the inputs once for it (nothing written), the cast
pass reads them again and writes FP8: 2 + 2 (+ 2) bytes read per element and 1 written, where the unfused path
writes the bf16 output (2), reads it for the amax (2) and again for the cast (2 + 1 written). With a scale known
before (delayed scaling), one pass writes FP8 and takes the amax for the next step's scale. Where a weight-gradient
GEMM will read the output, `*_cast_t` writes it also transposed in the same pass, over 2-D tiles (as
kernels.cast_transpose). Under current scaling the norm's casts take the rows' rstd from its amax pass
(`rmsnorm_amax` stores it), so what they write is what the amax measured and what the backward reads.
The amax passes walk their blocks or rows in a grid-stride loop over a few programs per SM, each adding its share
to the total by one atomic: with a program per block or row, the atomics on one address made the amax passes take
1.7-3.7x the time of reading their inputs (the `1b` step's profile on an H100).

Each is an op (`lowbit::swiglu_amax`, `lowbit::swiglu_cast(_t)`, `lowbit::rmsnorm_amax`, `lowbit::rmsnorm_cast(_t)`)
whose body launches its Triton kernel on a GPU and computes the torch formulas elsewhere. With Triton installed
it is a `torch.library.triton_op`: torch.compile traces into the body and inductor launches the kernel from its
own generated code. As opaque custom ops, their Python dispatch inside compiled blocks left the GPU waiting: the
`1b` step with them took 233 ms against 196 unfused, its forward's host time 98.8 ms against 57.0; a compiled
caller of the norm took 607 us per call through the custom ops and 128 us through one triton_op
(benchmarks/producer_launch.py on an H100, calls back to back; commit 4098191). As triton_ops the `1b` step's
GPU idle time is 3.3 ms (BENCHMARKS.md). tests/test_gpu.py's producer tests check the ops on a GPU.

Written here rather than taken from a library: torchao and TransformerEngine fuse these into their own
modules and kernels (TE's in CUDA, built with the package); lowbit's numerics stay its own formulas and Triton
only (no build step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.library import custom_op, triton_op, wrap_triton

from lowbit.numerics import kernels
from lowbit.numerics.qtensor import QTensor
from lowbit.numerics.scaling import Scaling, scale_from_amax

triton = kernels.triton
if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _amax_acc(acc, nan, h, mask):
        # running elementwise max |h| over the finite and infinite values, and 1 where a NaN was seen
        h = tl.where(mask, h, 0.0)
        return tl.maximum(acc, tl.where(h != h, 0.0, tl.abs(h))), tl.maximum(nan, tl.where(h != h, 1.0, 0.0))

    @triton.jit
    def _amax_into(stats_ptr, acc, nan):
        # a program's max |h| and NaN flag into stats by atomic max (as _amax_kernel), once per program: one pair
        # per block of a one-block-per-program grid queued tens of thousands of atomics on one address
        tl.atomic_max(stats_ptr, tl.max(acc, axis=0))
        tl.atomic_max(stats_ptr + 1, tl.max(nan, axis=0))

    @triton.jit
    def _to_fp8(h, scale, FMT_MAX: tl.constexpr, DTYPE: tl.constexpr):
        y = h * scale
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMT_MAX), FMT_MAX))
        return y.to(DTYPE, fp_downcast_rounding="rtne")

    @triton.jit
    def _swiglu_h(a, b):
        # torch's silu: x / (1 + exp(-x)) in fp32, IEEE division and expf; then rounded to a's dtype; the product
        # rounded to b's dtype, as torch's mul
        af = a.to(tl.float32)
        s = tl.math.div_rn(af, 1.0 + libdevice.exp(-af)).to(a.dtype).to(tl.float32)
        return (s * b.to(tl.float32)).to(b.dtype).to(tl.float32)

    @triton.jit
    def _norm_h(xr, rstd, w, OUT_W_DTYPE: tl.constexpr):
        # w · (x · rstd rounded to x's dtype); a weight in x's 16-bit dtype: torch's product is rounded to it
        h = w.to(tl.float32) * (xr.to(tl.float32) * rstd).to(xr.dtype).to(tl.float32)
        if OUT_W_DTYPE:
            h = h.to(w.dtype).to(tl.float32)
        return h

    @triton.jit
    def _swiglu_fp8_kernel(a_ptr, b_ptr, y_ptr, scale_ptr, stats_ptr, gate_ptr, n, FMT_MAX: tl.constexpr,
                           STORE: tl.constexpr, AMAX: tl.constexpr, BLOCK: tl.constexpr, GATED: tl.constexpr):
        # BLOCK-element blocks of silu(a)·b, strided over the grid (_grid); STORE: written as FP8; GATED: nothing
        # read or written where gate is 0 (a delayed scale's warm-up amax, needed on some steps only)
        if GATED:
            n = tl.where(tl.load(gate_ptr) != 0, n, 0)
        scale = tl.load(scale_ptr)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(tl.program_id(0), tl.cdiv(n, BLOCK), tl.num_programs(0)):
            offs = tl.cast(i, tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            h = _swiglu_h(tl.load(a_ptr + offs, mask=mask, other=0.0), tl.load(b_ptr + offs, mask=mask, other=0.0))
            if AMAX:
                acc, nan = _amax_acc(acc, nan, h, mask)
            if STORE:
                tl.store(y_ptr + offs, _to_fp8(h, scale, FMT_MAX, y_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            _amax_into(stats_ptr, acc, nan)

    @triton.jit
    def _rmsnorm_fp8_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, scale_ptr, stats_ptr, M, N, eps, FMT_MAX: tl.constexpr,
                            OUT_W_DTYPE: tl.constexpr, STORE: tl.constexpr, AMAX: tl.constexpr,
                            BLOCK: tl.constexpr, RSTD_GIVEN: tl.constexpr):
        # rows strided over the grid (_grid), each whole: rstd = 1/sqrt(mean(x²) + eps) in fp32 (stored), or with
        # RSTD_GIVEN read from rstd_ptr; out = w · (x · rstd rounded to x's dtype); STORE: out written as FP8
        cols = tl.arange(0, BLOCK)
        mask = cols < N
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        scale = tl.load(scale_ptr)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        nan = tl.zeros([BLOCK], dtype=tl.float32)
        for r in range(tl.program_id(0), M, tl.num_programs(0)):
            row = tl.cast(r, tl.int64)
            xr = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
            x = xr.to(tl.float32)
            # torch: the mean as the sum times 1/N (its MeanOps), rsqrt as CUDA's rsqrtf; mul_rn / add_rn: each
            # rounded on its own, as torch does, never contracted into a fused multiply-add
            if RSTD_GIVEN:
                rstd = tl.load(rstd_ptr + row)
            else:
                sq = tl.sum(libdevice.mul_rn(x, x), axis=0)
                # tl.cast, not .to: torch.compile's analysis of a triton_op may pass N and eps as Python numbers,
                # and its launch passes a float as fp64
                mean = libdevice.mul_rn(sq, tl.math.div_rn(1.0, tl.cast(N, tl.float32)))
                rstd = libdevice.rsqrt(libdevice.add_rn(mean, tl.cast(eps, tl.float32)))
                tl.store(rstd_ptr + row, rstd)
            h = _norm_h(xr, rstd, w, OUT_W_DTYPE)
            if AMAX:
                acc, nan = _amax_acc(acc, nan, h, mask)
            if STORE:
                tl.store(y_ptr + row * N + cols, _to_fp8(h, scale, FMT_MAX, y_ptr.dtype.element_ty), mask=mask)
        if AMAX:
            _amax_into(stats_ptr, acc, nan)

    @triton.jit
    def _store_both(y_ptr, yt_ptr, h, scale_ptr, rm, rn, mask, M, N, FMT_MAX: tl.constexpr):
        # the FP8 tile at [m, n] of y and at [n, m] of yt (as kernels._cast_transpose_kernel)
        y = _to_fp8(h, tl.load(scale_ptr), FMT_MAX, y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=mask)
        tl.store(yt_ptr + rn[None, :] * M + rm[:, None], y, mask=mask)

    @triton.jit
    def _partial_amax(part_ptr, acc, nan):
        # a program's max |h| and NaN flag into its own pair of part: no atomics (a 2-D grid has tens of thousands
        # of programs); the host reduces the pairs
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        tl.store(part_ptr + 2 * pid, tl.max(tl.max(acc, axis=1), axis=0))
        tl.store(part_ptr + 2 * pid + 1, tl.max(tl.max(nan, axis=1), axis=0))

    @triton.jit
    def _swiglu_fp8_t_kernel(a_ptr, b_ptr, y_ptr, yt_ptr, scale_ptr, part_ptr, M, N, FMT_MAX: tl.constexpr,
                             AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        # one [BM, BN] tile of silu(a)·b [M, N], written as FP8 row-major and transposed; AMAX: its amax into part
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None] * N + rn[None, :]
        h = _swiglu_h(tl.load(a_ptr + offs, mask=mask, other=0.0), tl.load(b_ptr + offs, mask=mask, other=0.0))
        _store_both(y_ptr, yt_ptr, h, scale_ptr, rm, rn, mask, M, N, FMT_MAX)
        if AMAX:
            zero = tl.zeros([BM, BN], dtype=tl.float32)
            acc, nan = _amax_acc(zero, zero, h, mask)
            _partial_amax(part_ptr, acc, nan)

    @triton.jit
    def _rmsnorm_fp8_t_kernel(x_ptr, w_ptr, rstd_ptr, y_ptr, yt_ptr, scale_ptr, part_ptr, M, N,
                              FMT_MAX: tl.constexpr, OUT_W_DTYPE: tl.constexpr, AMAX: tl.constexpr,
                              BM: tl.constexpr, BN: tl.constexpr):
        # one [BM, BN] tile of RMSNorm(x)·w with the rows' rstd given (the amax pass's), as FP8 row-major and
        # transposed; part and AMAX are _transposed_pair's shared operands, unused: the amax pass measured the amax
        rm = tl.program_id(0).to(tl.int64) * BM + tl.arange(0, BM)
        rn = tl.program_id(1).to(tl.int64) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        xr = tl.load(x_ptr + rm[:, None] * N + rn[None, :], mask=mask, other=0.0)
        rstd = tl.load(rstd_ptr + rm, mask=rm < M, other=0.0)[:, None]
        w = tl.load(w_ptr + rn, mask=rn < N, other=0.0)[None, :]
        _store_both(y_ptr, yt_ptr, _norm_h(xr, rstd, w, OUT_W_DTYPE), scale_ptr, rm, rn, mask, M, N, FMT_MAX)

SWIGLU_BLOCK, SWIGLU_WARPS = 2048, 8
PROGRAMS_PER_SM = 8  # the row kernels' grid: enough programs to keep every SM's memory pipes full


def _grid(device: torch.device, work: int) -> int:
    return kernels.grid_stride(device, work, PROGRAMS_PER_SM)


# the transposing casts' tile: 32 x 128, 4 warps, the fastest of benchmarks/producer_launch.py's seven on an H100
# (16384 tokens: swiglu_cast_t 218 us against 286 with kernels.cast_transpose's 128 x 128, 8 warps; the norm's 52
# against 59)
T_BLOCK_M, T_BLOCK_N, T_WARPS = 32, 128, 4


def _fp8(e5m2: bool) -> torch.dtype:
    return torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn


def _amax_of(stats: torch.Tensor) -> torch.Tensor:
    return torch.where(stats[1] > 0, torch.nan, stats[0])


def _op(name: str):
    """The decorator of these ops: a triton_op where Triton is installed, else a custom op (the torch formulas
    only); either way the body is also the fake (traceable: shapes, empty tensors, kernel launches)."""
    def dec(fn):
        if triton is not None:
            return triton_op(name, fn, mutates_args=())
        op = custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op
    return dec


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and triton is not None


def _gate(gate: torch.Tensor | None, stats: torch.Tensor) -> torch.Tensor:
    """The kernels' gate operand: `gate` as one fp32 (nonzero: run), or any pointer where there is none."""
    return gate.float().reshape(1) if gate is not None else stats


def _swiglu_launch(a, b, scale, e5m2: bool, store: bool, amax: bool, gate=None):
    a, b = a.contiguous(), b.contiguous()
    y = torch.empty(a.shape, device=a.device, dtype=_fp8(e5m2)) if store else a.new_empty(0, dtype=_fp8(e5m2))
    stats = torch.zeros(2, device=a.device, dtype=torch.float32)
    n = a.numel()
    s = scale.float().reshape(1) if scale is not None else stats
    with torch.cuda.device(a.device):  # an eager launch goes to the current device: make it a's
        wrap_triton(_swiglu_fp8_kernel)[(_grid(a.device, triton.cdiv(n, SWIGLU_BLOCK)),)](
            a, b, y, s, stats, _gate(gate, stats), n, FMT_MAX=kernels.FP8_MAX[y.dtype], STORE=store, AMAX=amax,
            BLOCK=SWIGLU_BLOCK, GATED=gate is not None, num_warps=SWIGLU_WARPS)
    return y, _amax_of(stats)


def _swiglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def _cast_ref(h: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> torch.Tensor:
    fmax = kernels.FP8_MAX[_fp8(e5m2)]
    return (h.float() * scale.float()).clamp(-fmax, fmax).to(_fp8(e5m2))


def _transposed_pair(kernel, M: int, N: int, like: torch.Tensor, e5m2: bool, *args, amax: bool = False,
                     **constexprs):
    """(y [M, N], yᵀ [N, M], the amax or 0) in FP8 from one launch of a transposing producer kernel over
    [T_BLOCK_M, T_BLOCK_N] tiles. `args`: the kernel's inputs, then the scale; `constexprs`: its own besides the
    format, the tile and AMAX."""
    y = torch.empty((M, N), device=like.device, dtype=_fp8(e5m2))
    yt = torch.empty((N, M), device=like.device, dtype=_fp8(e5m2))
    grid = (triton.cdiv(M, T_BLOCK_M), triton.cdiv(N, T_BLOCK_N))
    part = torch.empty((grid[0] * grid[1] if amax else 1, 2), device=like.device, dtype=torch.float32)
    *inputs, scale = args
    with torch.cuda.device(like.device):
        wrap_triton(kernel)[grid](*inputs, y, yt, scale.float().reshape(1), part, M, N,
                                  FMT_MAX=kernels.FP8_MAX[y.dtype], AMAX=amax, BM=T_BLOCK_M, BN=T_BLOCK_N,
                                  num_warps=T_WARPS, **constexprs)
    return y, yt, _amax_of(part.amax(0)) if amax else torch.zeros((), device=like.device, dtype=torch.float32)


def _gated(amax: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    return amax if gate is None else torch.where(gate != 0, amax, torch.zeros_like(amax))


@_op("lowbit::swiglu_amax")
def swiglu_amax(a: torch.Tensor, b: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """max |silu(a)·b| (NaN if one is), reading a and b once and writing nothing; with a `gate` (a 0-dim tensor)
    only where it is nonzero, else 0 without reading them (decided on the device: no host sync)."""
    if _on_gpu(a):
        return _swiglu_launch(a, b, None, False, False, True, gate)[1]
    return _gated(_swiglu_ref(a, b).abs().amax().float(), gate)


@_op("lowbit::swiglu_cast")
def swiglu_cast(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, e5m2: bool,
                with_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(a)·b cast with `scale` to E4M3 / E5M2, its amax when `with_amax` else 0), in one pass."""
    if _on_gpu(a):
        y, amax = _swiglu_launch(a, b, scale, e5m2, True, with_amax)
        return y, amax if with_amax else torch.zeros_like(amax)
    h = _swiglu_ref(a, b)
    return _cast_ref(h, scale, e5m2), \
        h.abs().amax().float() if with_amax else torch.zeros((), dtype=torch.float32, device=a.device)


@_op("lowbit::swiglu_cast_t")
def swiglu_cast_t(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, e5m2: bool,
                  with_amax: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(silu(a)·b of 2-D a, b cast with `scale`, row-major and transposed (the bytes a weight-gradient GEMM
    reads), its amax when `with_amax` else 0), in one pass."""
    if _on_gpu(a):
        a, b = a.contiguous(), b.contiguous()
        return _transposed_pair(_swiglu_fp8_t_kernel, *a.shape, a, e5m2, a, b, scale, amax=with_amax)
    h = _swiglu_ref(a, b)
    y = _cast_ref(h, scale, e5m2)
    return y, y.t().contiguous(), \
        h.abs().amax().float() if with_amax else torch.zeros((), dtype=torch.float32, device=a.device)


def _rmsnorm_launch(x, w, eps: float, scale, e5m2: bool, store: bool, rstd=None):
    x, w = x.contiguous(), w.contiguous()
    M, N = x.shape
    y = torch.empty((M, N), device=x.device, dtype=_fp8(e5m2)) if store else x.new_empty(0, dtype=_fp8(e5m2))
    given = rstd is not None
    rstd = rstd.float().contiguous().clone() if given else torch.empty((M, 1), device=x.device, dtype=torch.float32)
    stats = torch.zeros(2, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(N)
    with torch.cuda.device(x.device):
        wrap_triton(_rmsnorm_fp8_kernel)[(_grid(x.device, M),)](
            x, w, y, rstd, scale.float().reshape(1) if scale is not None else stats, stats, M, N, eps,
            FMT_MAX=kernels.FP8_MAX[y.dtype], OUT_W_DTYPE=_out_w_dtype(x, w), STORE=store, AMAX=True,
            BLOCK=block, RSTD_GIVEN=given, num_warps=8 if block >= 4096 else 4)
    return y, rstd, _amax_of(stats)


def _out_w_dtype(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch rounds the norm's product w·(x·rstd) to w's dtype (a 16-bit weight in x's dtype)."""
    return w.dtype != torch.float32 and w.dtype == x.dtype


def _rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.float()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * (h * rstd).to(x.dtype), rstd


@_op("lowbit::rmsnorm_amax")
def rmsnorm_amax(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |RMSNorm(x)·w| of a 2-D x, the fp32 rstd of each row [M, 1]), reading x once and writing only rstd."""
    if _on_gpu(x):
        _, rstd, amax = _rmsnorm_launch(x, w, eps, None, False, False)
        return amax, rstd
    h, rstd = _rmsnorm_ref(x, w, eps)
    return h.abs().amax().float(), rstd


@_op("lowbit::rmsnorm_cast")
def rmsnorm_cast(x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor, e5m2: bool,
                 rstd: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(RMSNorm(x)·w of a 2-D x cast with `scale`, the fp32 rstd of each row [M, 1] (what the norm's backward
    keeps), the amax), in one pass. Given `rstd` (rmsnorm_amax's), the rows use it: the cast then writes what
    the amax pass measured, bit for bit (the two kernels' sums over a row may differ in their last bit)."""
    if _on_gpu(x):
        return _rmsnorm_launch(x, w, eps, scale, e5m2, True, rstd)
    if rstd is None:
        h, rstd = _rmsnorm_ref(x, w, eps)
    else:
        h, rstd = w * (x.float() * rstd).to(x.dtype), rstd.float().clone()
    return _cast_ref(h, scale, e5m2), rstd, h.abs().amax().float()


@_op("lowbit::rmsnorm_cast_t")
def rmsnorm_cast_t(x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor,
                   e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(x)·w of a 2-D x given its rows' rstd (rmsnorm_amax's) cast with `scale`, row-major and transposed,
    in one pass."""
    if _on_gpu(x):
        x, w = x.contiguous(), w.contiguous()
        return _transposed_pair(_rmsnorm_fp8_t_kernel, *x.shape, x, e5m2, x, w, rstd.contiguous(), scale,
                                OUT_W_DTYPE=_out_w_dtype(x, w))[:2]
    y = _cast_ref(w * (x.float() * rstd).to(x.dtype), scale, e5m2)
    return y, y.t().contiguous()


def _current(amax: torch.Tensor, s: Scaling) -> torch.Tensor:
    """The current scale of scaling.current_scale from an amax (1 where it is bad)."""
    return scale_from_amax(amax, s)[0]


def swiglu_fp8(a: torch.Tensor, b: torch.Tensor, s: Scaling,
               scale: torch.Tensor | None = None) -> tuple[QTensor, torch.Tensor]:
    """silu(a)·b as FP8 [M, H] (a, b [M, H] contiguous) and its amax: with `scale` (a delayed one) in one pass,
    else by current scaling (an amax pass, then the cast)."""
    if scale is None:
        amax = torch.ops.lowbit.swiglu_amax(a, b)
        scale = _current(amax, s)
        y, _ = torch.ops.lowbit.swiglu_cast(a, b, scale, s.fmt == "e5m2", False)
    else:
        y, amax = torch.ops.lowbit.swiglu_cast(a, b, scale, s.fmt == "e5m2", True)
    return QTensor(y, scale.reciprocal(), s), amax


def rmsnorm_fp8(x: torch.Tensor, w: torch.Tensor, eps: float, s: Scaling,
                scale: torch.Tensor | None = None) -> tuple[QTensor, torch.Tensor, torch.Tensor]:
    """RMSNorm(x)·w of a 2-D x as FP8, the rstd of each row and the amax: with `scale` in one pass, else by
    current scaling (an amax pass, then the cast)."""
    rstd = None
    if scale is None:
        amax, rstd = torch.ops.lowbit.rmsnorm_amax(x, w, eps)
        scale = _current(amax, s)
    y, rstd, amax = torch.ops.lowbit.rmsnorm_cast(x, w, eps, scale, s.fmt == "e5m2", rstd)
    return QTensor(y, scale.reciprocal(), s), rstd, amax


def fused_usable(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels take these (as kernels.usable: eager, CUDA with FP8, contiguous)."""
    return all(kernels.usable(t) for t in tensors)
