"""LowbitAdamW's update on a GPU as two Triton passes per tensor: MS-AMP's two stages, each one pass over memory.

Pass one (`_amax_kernel`) reads the stored gradient, moments and (where its storage is scaled) the weights,
computes the new states in fp32 and reduces their amaxes into a small buffer by atomic max: no state is written,
and the unscaled weights are not read. Pass two (`_write_kernel`) computes the same states again, takes each
scaled state's new power-of-two scale from its amax (precision.pow2_scale, done on the float's bits, so exactly)
and writes the states once; it walks the tensor from its end, where pass one read last, so what L2 still holds
is read from there. The scales and step counters of a chunk of tensors are then written by two multi-tensor
ops. Bounded scales (optim.scales=bound) write in one pass, with scales from state_bounds; mixed ones run pass
one for the FP8 states alone (under fp8lm-o2 the first moment: it reads the gradient and the old moment, 2 of
the 6 bytes per parameter) before the writes.

Certified weight scales (CERTIFY, under amax scales): pass one reads no weights, only computing the largest
weight step B; the new weights' amax then lies within B of the record of the stored weights' amax (times
1 - lr wd), and where that interval takes one power-of-two scale the weights' amax pass (`_weights_amax_kernel`)
runs no blocks; where it does not, it reads the weights and only the few weights' gradient and moments that could
be the largest. Same bytes written (`_certified`); at `7b` on an H100, 45.4 -> 43.1 ms back to back.

Grouped launches (GROUP): the tensors of a chunk (adamw.CHUNK tensors of one shape) share one launch per pass,
PER programs per tensor, each reading its tensor's addresses from a small table on the device (`_table`; one a
captured CUDA graph may replay is kept for good): at `7b` about 40 launches per pass instead of 291, with one
last partial wave per chunk instead of per tensor. The programs compute what one launch per tensor computes, so
the bytes written are the same (tests/test_optim.py, under the interpreter; tests/test_gpu.py). At `7b` on an
H100, fp8lm-o2's update went from 42.1 to 38.6 ms back to back (benchmarks/optim_kernel_sweep.py, GROUP a knob).

Each program walks ITERS blocks, so its scalars (scales, bias corrections, correctly rounded divisions) are
computed once per ITERS x BLOCK elements, and STAGES blocks are in flight: Triton's pipeliner copies the next
blocks into shared memory (cp.async) while one is computed. The kernels wait on memory more than they issue
instructions: cutting fp8lm-o2's write pass from about 89 to 31 instructions per element (ptxas's count for sm90)
left its 7b update at 46.4 ms against 46.7 on an H100, and three blocks in flight took it to 44.2 (bounded scales
38.6 -> 35.9; benchmarks/optim_kernel_sweep.py, BENCHMARKS.md).

Written here rather than left to torch.compile: inductor splits the amax reductions into two kernels and its
elementwise kernels over FP8 and FP16 inputs ran fp8lm-o2's update at `7b` in 71 ms, these kernels in 55 ms
(BENCHMARKS.md, `lowbit bench optim --update both`). The math is adamw._fresh's, in the same order of
operations with correctly rounded division and square root, except in the weight's step (FAST): approximate ones
there (a few ulp of the step, far under the rounding of the weight it is added to) took a fifth off the update's
time when they were tl.sqrt and tl.fdiv (7b on an H100: 56.9 -> 46.3 ms; bounded scales 42.5 -> 37.1;
benchmarks/optim_kernel_sweep.py at commit 9c79953). A state is decoded by multiplying with the inverse of its power-of-two scale,
the same number as the division.
tests/test_gpu.py compares the states it writes with the compiled update's (with and without FAST). Nearest
rounding only: stochastic rounding (nanotron-r2), non-contiguous tensors and CPUs keep the torch formulas
(`supported`).

On by default where Triton runs; LOWBIT_TRITON_UPDATE=0 (or LOWBIT_TRITON=0, every kernel) keeps the compiled
passes.
"""

from __future__ import annotations

import contextlib
import os

import torch

from lowbit.numerics.kernels import ENABLED as KERNELS, triton
from lowbit.optim.precision import KINDS
from lowbit.optim.state_bounds import bound_table, from_amax

ENABLED = KERNELS and os.environ.get("LOWBIT_TRITON_UPDATE", "1") != "0"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # Triton's CPU interpreter: no PTX
BLOCK, ITERS, WARPS = 2048, 8, 8  # elements per load, loads per program, warps per program
STAGES = 3  # blocks in flight per program (Triton's pipeliner); the best of 1-3 on an H100
CERTIFY = True  # amax scales: the weights' scale from bounds where they fix it (`_certified`)
COUNTS: dict[torch.device, torch.Tensor] = {}  # per device: weights' amax passes run, tensors updated (certified);
# zero them in place to count afresh (reset_counts): a captured update adds to the tensors it was captured with
SLACK = 2.0 ** -16  # _certified's relative widening of its bounds: many fp32 roundings
FAST = True  # approximate sqrt and reciprocal in the weight's step (benchmarks/optim_kernel_sweep.py measures it)
GROUP = True  # a chunk's tensors (one shape) in one launch per pass, addresses from a table (`_table`)
MEMBERS = 10  # a grouped launch's table row: g, m, v, w, p, and the scales gs, ms, vs, ws, then the amax record
TABLES: dict[tuple, list] = {}  # (device, address rows) -> [their table there, uses] (`_table`)
TABLES_MAX = 256  # tables kept; past this many (of more than one use each), chunks launch per tensor

if triton is not None:
    import triton.language as tl

    _MEMBERS = tl.constexpr(MEMBERS)

    _SLACK = tl.constexpr(SLACK)

    @triton.jit
    def _place(PER, REVERSE: tl.constexpr):
        """This program's tensor of the launch and block of it: PER programs per tensor (a launch of one tensor:
        all of them); REVERSE walks from the last tensor's end."""
        pid = tl.program_id(0)
        if REVERSE:
            pid = tl.num_programs(0) - 1 - pid
        t = pid // PER
        return t, pid - t * PER

    @triton.jit
    def _member(tab_ptr, t, j: tl.constexpr, like):
        """Tensor t's j-th address of a grouped launch's table (MEMBERS per row), typed as `like`; 16-byte aligned
        (`_table` checks), as Triton assumes of a tensor argument: without it no load or store is vectorized and
        none is pipelined."""
        return tl.multiple_of(tl.load(tab_ptr + t * _MEMBERS + j).to(tl.pointer_type(like.dtype.element_ty)), 16)

    @triton.jit
    def _members(tab_ptr, t, g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, rec_ptr,
                 GROUPED: tl.constexpr):
        """The pointers of tensor t: a grouped launch reads them from its table, one tensor's launch has them."""
        if GROUPED:
            g_ptr, m_ptr, v_ptr = _member(tab_ptr, t, 0, g_ptr), _member(tab_ptr, t, 1, m_ptr), \
                _member(tab_ptr, t, 2, v_ptr)
            w_ptr, p_ptr = _member(tab_ptr, t, 3, w_ptr), _member(tab_ptr, t, 4, p_ptr)
            gs_ptr, ms_ptr = _member(tab_ptr, t, 5, gs_ptr), _member(tab_ptr, t, 6, ms_ptr)
            vs_ptr, ws_ptr = _member(tab_ptr, t, 7, vs_ptr), _member(tab_ptr, t, 8, ws_ptr)
            rec_ptr = _member(tab_ptr, t, 9, rec_ptr)
        return g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, rec_ptr

    @triton.jit
    def _loads(g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, V: tl.constexpr, W: tl.constexpr):
        """The stored gradient and first moment at offs and, with V and W, the second moment and the weights: every
        load issued before any math (in the math's order the weights' load sank below the moments' math, a second
        wait on memory per block)."""
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v, w = g, g
        if V:
            v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        if W:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        return g, m, v, w

    @triton.jit
    def _value(x, inv, SCALED: tl.constexpr):
        """A stored state in fp32: data / scale, as data * (1 / scale), the same number (the scales are powers of
        two), for a multiply in place of a correctly rounded division per element."""
        x = x.to(tl.float32)
        if SCALED:
            x = x * inv
        return x

    @triton.jit
    def _inverse(scale_ptr):
        return tl.math.div_rn(1.0, tl.load(scale_ptr))

    @triton.jit
    def _first(g, m, ig, im, w1, G_SCALED: tl.constexpr, M_SCALED: tl.constexpr):
        """The gradient and the new first moment: all the other states' amaxes need, all mixed scales' pass reads."""
        g = _value(g, ig, G_SCALED)
        m = _value(m, im, M_SCALED)
        return g, m + w1 * (g - m)

    @triton.jit
    def _approx(x, op: tl.constexpr, ASM: tl.constexpr):
        """PTX's approximate sqrt or reciprocal, flushing subnormals (one MUFU instruction; tl.sqrt and tl.fdiv add
        range fix-ups, about 8 instructions per element between them); tl's where no PTX runs (the interpreter).
        A flushed subnormal v changes nothing: sqrt(v) < 1.1e-19 vanishes when eps is added."""
        if ASM:
            return tl.inline_asm_elementwise(f"{op}.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        elif op == "sqrt":
            return tl.sqrt(x)
        else:
            return tl.fdiv(1.0, x)

    @triton.jit
    def _moments(g, m, v, ig, im, iv, beta2, w1, w2, G_SCALED: tl.constexpr, M_SCALED: tl.constexpr,
                 V_SCALED: tl.constexpr):
        """The new moments in fp32 (lerp with weight < 0.5 as torch computes it)."""
        g, m = _first(g, m, ig, im, w1, G_SCALED, M_SCALED)
        v = _value(v, iv, V_SCALED) * beta2
        return m, v + (w2 * g) * g

    @triton.jit
    def _step(m, v, step_size, bc2, eps, FAST: tl.constexpr, ASM: tl.constexpr = not INTERPRETED):
        """AdamW's step of the weights, lr m^ / (sqrt(v^) + eps), from the new moments; with FAST, approximate
        square root and reciprocal (a few ulp of the step)."""
        if FAST:
            denom = _approx(v, "sqrt", ASM) * tl.math.div_rn(1.0, bc2) + eps
            return (step_size * m) * _approx(denom, "rcp", ASM)
        return tl.math.div_rn(step_size * m, tl.math.div_rn(tl.math.sqrt_rn(v), bc2) + eps)

    @triton.jit
    def _fresh(g, m, v, w, ig, im, iv, iw, lr, wd, step_size, bc2, w1, beta2, w2, eps, G_SCALED: tl.constexpr,
               M_SCALED: tl.constexpr, V_SCALED: tl.constexpr, W_SCALED: tl.constexpr, FAST: tl.constexpr):
        """adamw._fresh on _loads' values: the new moments and weights in fp32. ig..iw: the inverse scales;
        step_size: lr / bc1, once per program."""
        m, v = _moments(g, m, v, ig, im, iv, beta2, w1, w2, G_SCALED, M_SCALED, V_SCALED)
        w = _value(w, iw, W_SCALED) * (1.0 - lr * wd)
        return m, v, w - _step(m, v, step_size, bc2, eps, FAST)

    @triton.jit
    def _scalars(gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr):
        """Per program: the inverse scales, lr, lr / bc1 and bc2 (adamw._bias's, computed by torch into buf)."""
        lr = tl.load(lr_ptr)
        step_size = tl.math.div_rn(lr, tl.load(buf_ptr + 3))
        return _inverse(gs_ptr), _inverse(ms_ptr), _inverse(vs_ptr), _inverse(ws_ptr), lr, step_size, \
            tl.load(buf_ptr + 7)

    @triton.jit
    def _larger(acc, x, mask):
        """A running max of |x| over the unmasked lanes, NaN kept (one instruction: max.NaN of |x|)."""
        return tl.maximum(acc, tl.where(mask, tl.abs(x), 0.0), propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _amax(acc):
        """A program's amax from _larger's lanes, NaN as Inf (a bad amax, as torch's; atomic max orders floats as
        their bits, where a NaN would not reliably win)."""
        return tl.max(tl.where(acc != acc, float("inf"), acc), axis=0)

    @triton.jit
    def _amax_kernel(g_ptr, m_ptr, v_ptr, w_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr, tab_ptr, PER, n,
                     wd, beta2, w1, w2, eps, G_SCALED: tl.constexpr, M_SCALED: tl.constexpr,
                     V_SCALED: tl.constexpr, W_SCALED: tl.constexpr, AMAX_M: tl.constexpr, AMAX_V: tl.constexpr,
                     AMAX_W: tl.constexpr, STEP_W: tl.constexpr, GROUPED: tl.constexpr, BLOCK: tl.constexpr,
                     ITERS: tl.constexpr, FAST: tl.constexpr, STAGES: tl.constexpr):
        """Pass one: the amaxes of the new states AMAX_* names into buf[0:3] and with STEP_W the largest weight
        step into buf[11]; the first moment's alone reads only the gradient and the old moment, and without
        AMAX_W the weights are not read. GROUPED: tensor t of the launch's table, its row t of buf."""
        t, blk = _place(PER, False)
        g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, rec_ptr = _members(
            tab_ptr, t, g_ptr, m_ptr, v_ptr, w_ptr, g_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, gs_ptr, GROUPED)
        buf_ptr += t * 16
        ig, im, iv, iw, lr, step_size, bc2 = _scalars(gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr)
        am = tl.zeros([BLOCK], dtype=tl.float32)
        av = tl.zeros([BLOCK], dtype=tl.float32)
        aw = tl.zeros([BLOCK], dtype=tl.float32)
        base = blk.to(tl.int64) * BLOCK * ITERS
        for i in tl.range(0, ITERS, num_stages=STAGES):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            g, m, v, w = _loads(g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, AMAX_V or AMAX_W or STEP_W, AMAX_W)
            if AMAX_W:
                m, v, w = _fresh(g, m, v, w, ig, im, iv, iw, lr, wd, step_size, bc2, w1, beta2, w2, eps, G_SCALED,
                                 M_SCALED, V_SCALED, W_SCALED, FAST)
                aw = _larger(aw, w, mask)
            elif AMAX_V or STEP_W:
                m, v = _moments(g, m, v, ig, im, iv, beta2, w1, w2, G_SCALED, M_SCALED, V_SCALED)
                if STEP_W:  # the weights' step alone, the same operations as _fresh's (see _certified)
                    aw = _larger(aw, _step(m, v, step_size, bc2, eps, FAST), mask)
            else:
                _, m = _first(g, m, ig, im, w1, G_SCALED, M_SCALED)
            if AMAX_V:
                av = _larger(av, v, mask)
            if AMAX_M:
                am = _larger(am, m, mask)
        if AMAX_M:
            tl.atomic_max(buf_ptr, _amax(am))
        if AMAX_V:
            tl.atomic_max(buf_ptr + 1, _amax(av))
        if AMAX_W:
            tl.atomic_max(buf_ptr + 2, _amax(aw))
        if STEP_W:
            tl.atomic_max(buf_ptr + 11, _amax(aw))

    @triton.jit
    def _weights_amax_kernel(g_ptr, m_ptr, v_ptr, w_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr, rec_ptr,
                             tab_ptr, PER, n, wd, beta2, w1, w2, eps, G_SCALED: tl.constexpr,
                             M_SCALED: tl.constexpr, V_SCALED: tl.constexpr, W_MAX: tl.constexpr,
                             GROUPED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr):
        """The new weights' amax into buf[2] after a pass one with STEP_W, where `_certified` does not fix their
        scale (no blocks at all where it does): it reads the weights, and the gradient and moments only where a
        weight could be the largest new one (|a| at least `cut`: a few in a tensor). The decision for the writes
        to read: buf[12] 1 where it ran, else 0 and the fixed scale at buf[13] (not computed again there, so no
        two compilations of the scalar math can disagree at a power of two's edge)."""
        t, blk = _place(PER, False)
        g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, rec_ptr = _members(
            tab_ptr, t, g_ptr, m_ptr, v_ptr, w_ptr, g_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, rec_ptr, GROUPED)
        buf_ptr += t * 16
        ig, im, iv, iw, lr, step_size, bc2 = _scalars(gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr)
        ok, fixed, cut = _certified(rec_ptr, buf_ptr, ws_ptr, lr, wd, W_MAX)
        if blk == 0:
            tl.store(buf_ptr + 12, tl.where(ok, 0.0, 1.0))
            tl.store(buf_ptr + 13, fixed)
        aw = tl.zeros([BLOCK], dtype=tl.float32)
        base = blk.to(tl.int64) * BLOCK * ITERS
        for i in tl.range(0, tl.where(ok, 0, ITERS)):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            w = tl.load(w_ptr + offs, mask=mask, other=0.0)
            # not `>= cut`: a NaN weight or cut (a NaN or Inf record or step) is a candidate, as in the full pass
            cand = mask & ~(tl.abs(_value(w, iw, True) * (1.0 - lr * wd)) < cut)
            g, m, v, unused = _loads(g_ptr, m_ptr, v_ptr, w_ptr, offs, cand, True, False)
            m, v, w = _fresh(g, m, v, w, ig, im, iv, iw, lr, wd, step_size, bc2, w1, beta2, w2, eps, G_SCALED,
                             M_SCALED, V_SCALED, True, FAST)
            aw = _larger(aw, w, cand)
        tl.atomic_max(buf_ptr + 2, _amax(aw), mask=~ok)

    @triton.jit
    def _certified(rec_ptr, buf_ptr, ws_ptr, lr, wd, W_MAX: tl.constexpr):
        """Whether the weights' new scale is known without their amax pass, that scale, and the |a| under which
        a weight cannot be the largest new one. Each new weight is a - b, a = w (1 - lr wd), b the step: with A
        the largest |a| (the record of the largest stored weight, times 1 - lr wd: rounding is monotonic) and B
        the largest |b| (STEP_W's), the new amax lies in [A - B, A + B], widened by SLACK for fp32 roundings the
        kernels may fuse apart. Where both ends take the same power-of-two scale, so does the amax (_pow2 is
        monotonic): the scale the amax pass would give, so the weights are written the same. A weight with
        |a| + B under A - B is not the largest. A record of 0 (none yet, or stale: see `update`) fixes nothing
        and rules no weight out."""
        a = tl.load(rec_ptr + 2) * (1.0 - lr * wd)
        b = tl.load(buf_ptr + 11)
        slack = (a + b) * _SLACK
        hi, lo = a + b + slack, a - b - slack
        old = tl.load(ws_ptr)
        s = _pow2(hi, old, W_MAX)
        return (lo > 0) & (hi < float("inf")) & (s == _pow2(lo, old, W_MAX)), s, lo - b - slack

    @triton.jit
    def _pow2(amax, old, FMAX: tl.constexpr):
        """precision.pow2_scale: the largest power of two s with amax * s <= FMAX, floor(log2) read off the
        exponent bits of FMAX / amax; the old scale (or 1) when amax is 0, Inf or NaN."""
        old = tl.where((old > 0) & (old < float("inf")), old, 1.0)
        good = (amax > 0) & (amax < float("inf"))
        safe = tl.where(good, amax, 1.0)
        q = tl.math.div_rn(safe * 0.0 + FMAX, safe)
        k = ((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        k = tl.minimum(tl.maximum(k, -126), 126)
        s = ((k + 127) << 23).to(tl.float32, bitcast=True)
        s = tl.where(safe * s > FMAX, s * 0.5, s)
        return tl.where(good, s, old)

    @triton.jit
    def _in_range(x, scale, SCALED: tl.constexpr, FMAX: tl.constexpr):
        """A state in its stored units: scaled and clamped to the format's range (NaN kept)."""
        if SCALED:
            x = tl.clamp(x * scale, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        return x

    @triton.jit
    def _store(ptr, offs, mask, x):
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    @triton.jit
    def _rounded(ptr, a, inv):
        """The stored form of a magnitude `a` (in the state's scaled units), decoded; Inf (a NaN or Inf seen) kept."""
        r = a.to(ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32) * inv
        return tl.where(a < float("inf"), r, a)

    @triton.jit
    def _write_kernel(g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr, new_ptr,
                      new_stride, tab_ptr, PER, n, wd, beta2, w1, w2, eps, G_SCALED: tl.constexpr,
                      M_SCALED: tl.constexpr, V_SCALED: tl.constexpr, W_SCALED: tl.constexpr, M_MAX: tl.constexpr,
                      V_MAX: tl.constexpr, W_MAX: tl.constexpr, WRITE_P: tl.constexpr, AMAX_M: tl.constexpr,
                      AMAX_V: tl.constexpr, AMAX_W: tl.constexpr, CERT: tl.constexpr, TRACK: tl.constexpr,
                      GROUPED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr, FAST: tl.constexpr,
                      STAGES: tl.constexpr):
        """The writes, every kind of scales: the states written with the scales at new_ptr (m, v, w), or for a
        state AMAX_* names, the scale of its amax that _amax_kernel left in buf (kept at buf[4:7]). TRACK: the
        amaxes of what is written into buf[8:11] by atomic max (bounded and mixed scales' record). After a pass
        one it walks from the end, where that pass read last, so what L2 still holds is read from there. GROUPED:
        tensor t of the launch's table, its row t of buf and of new (rows new_stride apart)."""
        t, blk = _place(PER, AMAX_M or AMAX_V or AMAX_W)
        g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, rec_ptr = _members(
            tab_ptr, t, g_ptr, m_ptr, v_ptr, w_ptr, p_ptr, gs_ptr, ms_ptr, vs_ptr, ws_ptr, gs_ptr, GROUPED)
        buf_ptr += t * 16
        new_ptr += t * new_stride
        ig, im, iv, iw, lr, step_size, bc2 = _scalars(gs_ptr, ms_ptr, vs_ptr, ws_ptr, lr_ptr, buf_ptr)
        nm, nv, nw = tl.load(new_ptr), tl.load(new_ptr + 1), tl.load(new_ptr + 2)
        if AMAX_M:
            nm = _pow2(tl.load(buf_ptr), tl.load(ms_ptr), M_MAX)
        if AMAX_V:
            nv = _pow2(tl.load(buf_ptr + 1), tl.load(vs_ptr), V_MAX)
        if AMAX_W:
            nw = _pow2(tl.load(buf_ptr + 2), tl.load(ws_ptr), W_MAX)
            if CERT:  # the weights' amax pass's decision (_weights_amax_kernel)
                nw = tl.where(tl.load(buf_ptr + 12) == 0.0, tl.load(buf_ptr + 13), nw)
        am = tl.zeros([BLOCK], dtype=tl.float32)
        av = tl.zeros([BLOCK], dtype=tl.float32)
        aw = tl.zeros([BLOCK], dtype=tl.float32)
        if AMAX_M or AMAX_V or AMAX_W:
            if blk == 0:
                tl.store(buf_ptr + 4, nm)
                tl.store(buf_ptr + 5, nv)
                tl.store(buf_ptr + 6, nw)
        base = blk.to(tl.int64) * BLOCK * ITERS
        for i in tl.range(0, ITERS, num_stages=STAGES):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            g, m, v, w = _loads(g_ptr, m_ptr, v_ptr, w_ptr, offs, mask, True, True)
            m, v, w = _fresh(g, m, v, w, ig, im, iv, iw, lr, wd, step_size, bc2, w1, beta2, w2, eps, G_SCALED,
                             M_SCALED, V_SCALED, W_SCALED, FAST)
            sm, sv, sw = _in_range(m, nm, M_SCALED, M_MAX), _in_range(v, nv, V_SCALED, V_MAX), \
                _in_range(w, nw, W_SCALED, W_MAX)
            _store(m_ptr, offs, mask, sm)
            _store(v_ptr, offs, mask, sv)
            _store(w_ptr, offs, mask, sw)
            if WRITE_P:  # a separate master: the weights are written from it, rounded to nearest
                _store(p_ptr, offs, mask, w)
            if TRACK:  # rounding is monotonic: the largest stored value is the largest of these rounded once
                am, av, aw = _larger(am, sm, mask), _larger(av, sv, mask), _larger(aw, sw, mask)
        if TRACK:  # an unscaled state's record stays 0, as adamw's stored_amaxes gives it
            if M_SCALED:
                tl.atomic_max(buf_ptr + 8, _rounded(m_ptr, _amax(am), tl.math.div_rn(1.0, nm)))
            if V_SCALED:
                tl.atomic_max(buf_ptr + 9, _rounded(v_ptr, _amax(av), tl.math.div_rn(1.0, nv)))
            if W_SCALED:
                tl.atomic_max(buf_ptr + 10, _rounded(w_ptr, _amax(aw), tl.math.div_rn(1.0, nw)))


def _scaled(kind: str) -> bool:
    return kind != "none" and KINDS[kind][1]


def supported(items: list[tuple], kinds) -> bool:
    """Whether the kernels run this chunk: CUDA with Triton, nearest rounding, every tensor contiguous, the
    gradient and states of one size (a 0-dim master or weight is a placeholder)."""
    if not ENABLED or triton is None or kinds[3] != "nearest":
        return False
    for p, g, _, _, m, _, v, _, master, _, *_ in items:
        full = [t for t in (p, g, m, v, master) if t.dim()]
        if not g.is_cuda or any(not t.is_contiguous() or t.numel() != g.numel() for t in full):
            return False
    return True


def _prepare(items: list[tuple], lr: torch.Tensor, beta1: float, beta2: float, kinds):
    """The per-call constants of a chunk: the kernels' flags and ranges, and a buffer per item (amaxes, then the
    bias corrections adamw._bias computes at [3] and [7], the new scales at [4:7], the written states' amaxes at
    [8:11] under bounded and mixed scales and where kept; [11] the largest weight step, [12] 1 where the
    weights' amax pass ran and [13] the certified scale where it did not, with certified scales; [14:16] unused)."""
    k_m, k_v, k_master = kinds[:3]
    from_master = k_master != "none"
    flags = dict(M_SCALED=_scaled(k_m), V_SCALED=_scaled(k_v), W_SCALED=_scaled(k_master))
    maxes = dict(M_MAX=KINDS[k_m][2], V_MAX=KINDS[k_v][2], W_MAX=KINDS[k_master][2] if from_master else 1.0)
    buf = torch.zeros(len(items), 16, device=lr.device)
    t = torch.stack([item[10] for item in items]) + 1
    buf[:, 3], buf[:, 7] = 1 - beta1 ** t, torch.sqrt(1 - beta2 ** t)
    return flags, maxes, buf


def update(items: list[tuple], lr: torch.Tensor, beta1: float, beta2: float, eps: float, kinds) -> torch.Tensor:
    """One AdamW step on the stored states of a chunk of tensors (adamw._update_all's items), in place: per tensor
    an amax pass for the states whose new scale comes from their new amax (every scaled state under amax scales,
    the FP8 ones under mixed scales), then the writes; one pass where every scale is bounded (kinds[5] == "bound").
    Amax scales with a record of the stored weights' amax (item[13], `kept`) read no weights in pass one where
    `_certified` fixes their scale. Returns the chunk's buffer (_prepare's)."""
    flags, maxes, buf = _prepare(items, lr, beta1, beta2, kinds)
    bounded = kinds[5] != "amax"
    table = bound_table(items, lr, beta1, beta2, kinds) if bounded else buf  # amax scales: a row loaded, never used
    exact = {f"AMAX_{n}": flags[f"{n}_SCALED"] and from_amax(k, kinds[5]) for n, k in zip("MVW", kinds[:3])}
    keep = exact["AMAX_W"] and kept(items)  # amax scales: the written states' amaxes recorded for _certified
    cert = keep and CERTIFY
    from_master, own = kinds[2] != "none", kinds[4]
    coef = dict(beta2=beta2, w1=1 - beta1, w2=1 - beta2, eps=eps)
    scales, news, steps = [], [], []
    with torch.cuda.device(lr.device) if lr.is_cuda else contextlib.nullcontext():  # Triton's interpreter: CPU
        tab = _table(items, from_master, cert) if GROUP and len(items) > 1 else None
        launches = [(0, items, tab)] if tab is not None else [(i, [item], None) for i, item in enumerate(items)]
        for first, group, tab in launches:  # (first item's index, its items, their table or None)
            p, g, gs, g_kind, m, ms, v, vs, master, ws, step, wd, _, rec = group[0]
            n = g.numel()
            args = (g, m, v, master if from_master else p, p, gs, ms, vs, ws, lr, buf[first])
            consts = dict(G_SCALED=_scaled(g_kind), **flags, **maxes, WRITE_P=from_master and not own)
            where = dict(tab=buf if tab is None else tab, per=_grid(n)[0], count=len(group))
            if any(exact.values()):
                _pass_one(args, n, wd, coef, consts, exact, rec if cert else None, where)
            _write_kernel[(where["per"] * len(group),)](
                *args, table[first], table.stride(0), where["tab"], where["per"], n, wd, **coef, **consts,
                **exact, CERT=cert, TRACK=bounded or keep, GROUPED=tab is not None, BLOCK=BLOCK, ITERS=ITERS,
                FAST=FAST, STAGES=STAGES, num_warps=WARPS)
        for i, (p, g, gs, g_kind, m, ms, v, vs, master, ws, step, *_) in enumerate(items):
            for j, (name, s) in enumerate((("m", ms), ("v", vs), ("w", ws))):
                if flags[f"{name.upper()}_SCALED"]:
                    scales.append(s)
                    news.append(buf[i, 4 + j] if exact[f"AMAX_{name.upper()}"] else table[i, j])
            steps.append(step)
    if scales:
        torch._foreach_copy_(scales, news)
    if cert:
        _count(buf[:, 12], len(items))
    if bounded or keep:
        torch._foreach_copy_([item[13] for item in items], list(buf[:, 8:11].unbind(0)))
    torch._foreach_add_(steps, 1)
    return buf


def _count(ran: torch.Tensor, n: int) -> None:
    """COUNTS: the weights' amax passes `ran` (1 each) and the tensors updated, on the device (a CUDA graph replays
    the additions). Made outside a capture only (an allocation there would be replayed as a reset): a graph's
    eager run before it has made it."""
    counts = COUNTS.get(ran.device)
    if counts is None:
        if ran.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        counts = COUNTS[ran.device] = torch.zeros(2, dtype=torch.float64, device=ran.device)
    counts[0] += ran.sum()
    counts[1] += n


def reset_counts() -> None:
    for counts in COUNTS.values():
        counts.zero_()


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK * ITERS),)


def _pass_one(args, n: int, wd: float, coef: dict, consts: dict, amax: dict, rec: torch.Tensor | None,
              where: dict) -> None:
    """The amaxes of the new states `amax` names (AMAX_M, AMAX_V, AMAX_W) into the buffer rows; with `rec`
    (certified scales: the record of the stored weights' amax), pass one reads no weights (the largest step
    instead of their amax), and their amax pass runs only where `_certified` does not fix their scale. `where`:
    the launch's table (or a stand-in), programs per tensor and tensors (`update`)."""
    cert = rec is not None
    g, m, v, w, p, *scale_args = args
    flags = {k: consts[k] for k in ("G_SCALED", "M_SCALED", "V_SCALED")}
    grid, grouped = (where["per"] * where["count"],), where["count"] > 1
    _amax_kernel[grid](g, m, v, w, *scale_args, where["tab"], where["per"], n, wd, **coef, **flags,
                       W_SCALED=consts["W_SCALED"], **dict(amax, AMAX_W=amax["AMAX_W"] and not cert), STEP_W=cert,
                       GROUPED=grouped, BLOCK=BLOCK, ITERS=ITERS, FAST=FAST, STAGES=STAGES, num_warps=WARPS)
    if cert:
        _weights_amax_kernel[grid](g, m, v, w, *scale_args, rec, where["tab"], where["per"], n, wd, **coef,
                                   **flags, W_MAX=consts["W_MAX"], GROUPED=grouped, BLOCK=BLOCK, ITERS=ITERS,
                                   FAST=FAST, num_warps=WARPS)


def _table(items: list[tuple], from_master: bool, cert: bool) -> torch.Tensor | None:
    """The addresses a grouped launch reads (MEMBERS per tensor: g, m, v, w, p, gs, ms, vs, ws, record), or None
    where the chunk's tensors cannot share a launch: sizes, gradient kinds, weight decays or dtypes differ, an
    address is not 16-byte aligned, or no table may be made (a CUDA graph is being captured: its eager run made
    it; TABLES_MAX reached). A table used twice is kept for good: a CUDA graph captures a call only after running
    it eagerly with the same tensors, and replays its reads of the table. One used once (gradients that move each
    step) makes room for others."""
    members = [(g, m, v, master if from_master else p, p, gs, ms, vs, ws, rec if cert else gs)
               for p, g, gs, _, m, ms, v, vs, master, ws, _, _, _, rec in items]
    if len({(item[1].numel(), item[3], item[11], *(t.dtype for t in row)) for item, row in zip(items, members)}) > 1:
        return None
    rows = tuple(tuple(t.data_ptr() for t in row) for row in members)
    if any(a % 16 for row in rows for a in row):  # _member's promise
        return None
    device = items[0][1].device
    entry = TABLES.get((device, rows))
    if entry is not None:
        entry[1] += 1
        return entry[0]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if len(TABLES) >= TABLES_MAX:
        for key in [k for k, (_, uses) in TABLES.items() if uses == 1]:
            del TABLES[key]  # the stream's later allocations wait for a launch still reading it
        if len(TABLES) >= TABLES_MAX:
            return None
    host = torch.tensor(rows, dtype=torch.int64)
    tab = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    TABLES[(device, rows)] = [tab, 1]
    return tab


def kept(items: list[tuple]) -> bool:
    """Whether every item of the chunk has its own record of its states' amaxes (a 1-d item[13]; LowbitAdamW keeps
    one under amax scales on a CUDA device): the writes keep it, the other updates zero it (`with_fallback`)."""
    return all(item[13].dim() == 1 for item in items)


def available() -> bool:
    """Whether the kernels can run here at all (Triton importable, lowbit's kernels not turned off)."""
    return KERNELS and triton is not None


@contextlib.contextmanager
def forced(on: bool):
    """The kernels on or off inside the block, whatever LOWBIT_TRITON_UPDATE says (`lowbit bench optim --update`)."""
    global ENABLED
    old, ENABLED = ENABLED, on and available()
    try:
        yield
    finally:
        ENABLED = old


def with_fallback(fallback):
    """The update of adamw._fn: the kernels where `supported`, else `fallback` (the compiled passes)."""
    def call(items, lr, beta1, beta2, eps, kinds, span=None):
        if supported(items, kinds):
            update(items, lr, beta1, beta2, eps, kinds)
        else:
            fallback(items, lr, beta1, beta2, eps, kinds, span)
            if kinds[5] == "amax" and kept(items):  # states written without their amaxes recorded: unknown now
                torch._foreach_zero_([item[13] for item in items])
    return call

