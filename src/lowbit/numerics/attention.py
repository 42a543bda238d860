"""FP8 causal attention (numerics.fp8_attention): Q, K, V cast to E4M3 with a power-of-two scale per (sequence,
head), QKᵀ and PV on FP8 operands with fp32 accumulation, online softmax, P cast to E4M3 with the fixed scale 2^8;
the backward is bf16 attention's at the dequantized operands with this forward's output and log-sum-exp.

Written here rather than taken from a library: cuDNN's and FlashAttention-3's FP8 forwards are not reachable from
torch's SDPA (no FP8 inputs) and FA3 is a separate CUDA build, which lowbit does not take on (numerics must be
Triton or torch, no build step). Owning the kernel also lets the CPU path emulate its numerics exactly, block by
block, so that tests and the fidelity study run anywhere, and lets the scales come from lowbit's own cast helpers.

Choices. Scales per (sequence, head) rather than per tensor: with power-of-two scales the two round alike while
every head stays in E4M3's normal range (rounding is relative there), but heads whose magnitudes differ by about
2^8 or more would put the small ones into the subnormals under one scale (measured in docs/numerics.md: worst head
11.4 dB against 26.7 dB); B·H scales cost nothing. Powers of two: dequantization is exact, so the descale folds into the softmax's exponent constant. P to E4M3
(FA3's choice) rather than bf16: PV is half the FLOPs and an FP8 tensor core takes both operands in FP8; P lies in
[0, 1] (relative to the running row max), so the fixed scale 256 puts it under E4M3's max 448 and moves the
smallest representable weight from 2^-9 to 2^-17. The row sum l is of the fp32 P (as FA3's), so the log-sum-exp
handed to the backward is that of the dequantized scores.

`lowbit::fp8_attention` (q, k, v [B, H, L, D] in a float dtype) -> (out [B, H, L, D] in q's dtype, lse [B, H, L]
fp32, natural log of the scaled scores) is a custom op: on a GPU with Triton and FP8 the kernel below, elsewhere
`emulate`, the same computation in torch ops, in the kernel's blocks and order of operations. Its backward
(`lowbit::fp8_attention_backward`) is aten's flash-attention backward on CUDA, the math formula elsewhere.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.models.llama import CausalSDPA
from lowbit.numerics import kernels
from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling

triton = kernels.triton
if triton is not None:
    import triton.language as tl

HEAD_SCALING = Scaling("e4m3", "row", pow2=True)  # one row per (sequence, head): L·D values
P_SCALE = 256.0  # P in [0, 1] times 2^8: at most 256 < 448, exact to undo
LOG2E = 1.4426950408889634
BLOCK_N = 64  # key block of the kernel; `emulate` walks the keys in the same blocks
BLOCK_M, NUM_WARPS, NUM_STAGES = 128, 8, 2  # query block and launch settings (module globals: bench may retune)


def quantize_heads(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, H, L, D] cast to E4M3 with a power-of-two scale per (b, h) by lowbit's cast helpers: (data [B, H, L,
    D] float8_e4m3fn, scale_inv [B, H] fp32). A head of zeros (or with a NaN/Inf) keeps scale 1."""
    B, H, L, D = x.shape
    q = quantize(x.detach().reshape(B * H, L * D), HEAD_SCALING)
    return q.data.view(B, H, L, D), q.scale_inv.reshape(B, H).float()


def dequantize_heads(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale_inv[:, :, None, None]).to(dtype)


def emulate(q8, k8, v8, q_si, k_si, v_si, sm_scale: float, block_n: int = BLOCK_N) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    """The kernel's computation in fp32 torch ops: (out fp32 [B, H, L, D], lse fp32 [B, H, L]). The keys are
    walked in blocks of `block_n` with the running max, rescaling and P's E4M3 cast of the online softmax, as the
    kernel does (a fully masked block leaves the state as it is, so the kernel skipping it changes nothing)."""
    L, dev = q8.shape[2], q8.device
    c = torch.tensor(sm_scale * LOG2E, dtype=torch.float32, device=dev)  # the kernel's fp32 argument
    qk_scale = ((q_si * k_si).float() * c)[:, :, None, None]
    s = (q8.float() @ k8.float().transpose(-1, -2)) * qk_scale  # log2 units
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=dev).triu(1), -math.inf)
    m = torch.full(s.shape[:-1], -math.inf, device=dev)
    l_sum = torch.zeros(s.shape[:-1], device=dev)
    acc = torch.zeros(q8.shape, device=dev)
    v = v8.float()
    for start in range(0, L, block_n):
        blk = s[..., start:start + block_n]
        m_new = torch.maximum(m, blk.amax(-1))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(blk - m_new[..., None])
        l_sum = l_sum * alpha + p.sum(-1)
        p8 = (p * P_SCALE).to(torch.float8_e4m3fn).float()
        acc = acc * alpha[..., None] + p8 @ v[..., start:start + block_n, :]
        m = m_new
    out = acc * (v_si[:, :, None, None] / P_SCALE) / l_sum[..., None]
    return out, (m + torch.log2(l_sum)) / LOG2E


def runs_kernel(q: torch.Tensor) -> bool:
    """Whether the op runs the Triton kernel for `q`: on a GPU where lowbit's kernels run (Triton, FP8, not
    LOWBIT_TRITON=0), a head size tl.dot takes. Any layout: the casts write contiguous FP8 copies (the model's q
    is a transposed view), so the check is asked of a contiguous tensor like q."""
    return q.shape[-1] in (16, 32, 64, 128, 256) and kernels.usable(q.new_empty(1))


# Triton's CPU interpreter rounds fp32 -> E4M3 wrongly where rounding carries into the next binade (124.2 -> 64,
# measured with Triton 3.9): under it the kernel rounds P onto the E4M3 grid in fp32 arithmetic first, so the cast
# that follows is exact. A GPU casts in hardware (round to nearest even) and skips this.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if triton is not None:

    @triton.jit
    def _e4m3_grid(x):
        # x >= 0 (at most 448) rounded to nearest even onto E4M3's grid in fp32: the quantum of x's binade (2^-9
        # below the normals) added as 2^23 quanta, then taken away (fp32 addition rounds to nearest even)
        e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        qe = tl.maximum(e, -6) - 3
        magic = ((qe + 23 + 127) << 23).to(tl.float32, bitcast=True)
        return (x + magic) - magic

    @triton.jit
    def _fp8_attention_kernel(q_ptr, k_ptr, v_ptr, q_si_ptr, k_si_ptr, v_si_ptr, o_ptr, lse_ptr, c, L,
                              svh, svn, svd, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                              P_SCALE: tl.constexpr, GRID_ROUND: tl.constexpr):
        # One [BM] block of queries of one (b, h): q, k, o [B*H, L, D] contiguous; v at strides (svh, svn, svd),
        # on a GPU transposed ([D, L] per head, svd = L) so that PV's FP8 operand is K-major. Causal: the key
        # blocks past the query block's last row are never loaded.
        start_m = tl.program_id(0) * BM
        bh = tl.program_id(1).to(tl.int64)
        offs_m = start_m + tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        base = bh * L * D
        q = tl.load(q_ptr + base + offs_m[:, None] * D + offs_d[None, :], mask=offs_m[:, None] < L, other=0.0)
        qk_scale = tl.load(q_si_ptr + bh) * tl.load(k_si_ptr + bh) * c
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, D], dtype=tl.float32)
        hi = tl.minimum(start_m + BM, L)
        for start_n in range(0, hi, BN):
            offs_n = start_n + tl.arange(0, BN)
            k = tl.load(k_ptr + base + offs_n[None, :] * D + offs_d[:, None], mask=offs_n[None, :] < L, other=0.0)
            s = tl.dot(q, k) * qk_scale  # [BM, BN], log2 units
            s = tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n[None, :] < L), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            p8 = p * P_SCALE
            if GRID_ROUND:
                p8 = _e4m3_grid(p8)
            p8 = p8.to(tl.float8e4nv, fp_downcast_rounding="rtne")
            v = tl.load(v_ptr + bh * svh + offs_n[:, None] * svn + offs_d[None, :] * svd,
                        mask=offs_n[:, None] < L, other=0.0)
            acc = acc * alpha[:, None]
            acc = tl.dot(p8, v, acc)
            m_i = m_new
        out = acc * (tl.load(v_si_ptr + bh) / P_SCALE) / l_i[:, None]
        tl.store(o_ptr + base + offs_m[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=offs_m[:, None] < L)
        tl.store(lse_ptr + bh * L + offs_m, (m_i + tl.math.log2(l_i)) / 1.4426950408889634, mask=offs_m < L)


def triton_forward(q8, k8, v8, q_si, k_si, v_si, sm_scale: float, out_dtype: torch.dtype,
                   transpose_v: bool = True, block_m: int | None = None,
                   block_n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel on FP8 operands [B, H, L, D] (contiguous) and their [B, H] scale_invs: (out in
    `out_dtype`, lse fp32). `transpose_v`: hand V to the kernel as [D, L] per head (what Hopper's FP8 MMA takes);
    the interpreter takes either."""
    B, H, L, D = q8.shape
    bm, bn = block_m or BLOCK_M, block_n or BLOCK_N
    out = torch.empty((B, H, L, D), device=q8.device, dtype=out_dtype)
    lse = torch.empty((B, H, L), device=q8.device, dtype=torch.float32)
    if transpose_v:
        v = v8.transpose(-1, -2).contiguous()
        strides = (L * D, 1, L)
    else:
        v, strides = v8.contiguous(), (L * D, D, 1)
    grid = (triton.cdiv(L, bm), B * H)
    with torch.cuda.device(q8.device) if q8.is_cuda else contextlib.nullcontext():
        _fp8_attention_kernel[grid](q8.contiguous(), k8.contiguous(), v, q_si.contiguous(), k_si.contiguous(),
                                    v_si.contiguous(), out, lse, sm_scale * LOG2E, L, *strides, D=D, BM=bm, BN=bn,
                                    P_SCALE=P_SCALE, GRID_ROUND=INTERPRETED, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out, lse


@torch.library.custom_op("lowbit::fp8_attention", mutates_args=())
def fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    """Causal attention of q, k, v [B, H, L, D] on their E4M3 casts: (out [B, H, L, D] in q's dtype, lse [B, H, L]
    fp32). The Triton kernel where `runs_kernel`, else `emulate` (the same numerics)."""
    (q8, q_si), (k8, k_si), (v8, v_si) = quantize_heads(q), quantize_heads(k), quantize_heads(v)
    if runs_kernel(q):
        return triton_forward(q8, k8, v8, q_si, k_si, v_si, sm_scale, q.dtype)
    out, lse = emulate(q8, k8, v8, q_si, k_si, v_si, sm_scale)
    return out.to(q.dtype), lse


@fp8_attention.register_fake
def _(q, k, v, sm_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)  # contiguous, as the real ones


def math_backward(dout, q, k, v, out, lse, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal attention's gradients in fp32, P rebuilt from `lse`: dV = PᵀdO, dS = P ⊙ (dO Vᵀ - rowsum(dO ⊙ O)),
    dQ = dS K·scale, dK = dSᵀ Q·scale. O(L²) memory: the CPU's backward, and the reference of the GPU's."""
    q, k, v, dout, out = (t.float() for t in (q, k, v, dout, out))
    L = q.shape[2]
    s = (q @ k.transpose(-1, -2)) * sm_scale
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    p = torch.exp(s - lse[..., None].float())
    dv = p.transpose(-1, -2) @ dout
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out).sum(-1, keepdim=True))
    return ds @ k * sm_scale, ds.transpose(-1, -2) @ q * sm_scale, dv


@torch.library.custom_op("lowbit::fp8_attention_backward", mutates_args=())
def fp8_attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the forward's q, k, v: attention's backward evaluated at their dequantized E4M3 casts (the
    cast passes gradients straight through) with the FP8 forward's out and lse. On CUDA aten's flash backward in
    bf16 (fp16 for fp16 inputs); elsewhere `math_backward`."""
    if q.is_cuda and q.shape[-1] <= 256:
        # in bf16 (fp16 inputs: fp16), exact for the operands: an E4M3 value times a power of two fits bf16
        low = torch.float16 if q.dtype == torch.float16 else torch.bfloat16
        qd, kd, vd = (dequantize_heads(*quantize_heads(t), low) for t in (q, k, v))
        L = q.shape[2]
        seed = torch.empty((), dtype=torch.int64, device=q.device)  # read only with dropout
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout.to(low).contiguous(), qd, kd, vd, out.to(low).contiguous(), lse.contiguous(), None, None, L, L, 0.0,
            True, seed, seed, scale=sm_scale)
        return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()
    qd, kd, vd = (dequantize_heads(*quantize_heads(t), t.dtype) for t in (q, k, v))
    dq, dk, dv = math_backward(dout, qd, kd, vd, out, lse, sm_scale)
    return dq.to(q.dtype).contiguous(), dk.to(k.dtype).contiguous(), dv.to(v.dtype).contiguous()


@fp8_attention_backward.register_fake
def _(dout, q, k, v, out, lse, sm_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, sm_scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.sm_scale = sm_scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.lowbit.fp8_attention_backward(dout, q, k, v, out, lse, ctx.sm_scale)
    return dq, dk, dv, None


torch.library.register_autograd("lowbit::fp8_attention", _backward, setup_context=_setup_context)


class FP8Attention(nn.Module):
    """The attention core [B, H, L, D] -> [B, H, L, D] of numerics.fp8_attention (causal, no dropout), swapped in
    for CausalSDPA by `recipes.convert`; `backend` is the SDPA backend it replaced, given back by unconvert."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.backend = backend

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions=None) -> torch.Tensor:
        out, _ = torch.ops.lowbit.fp8_attention(q, k, v, 1.0 / math.sqrt(q.shape[-1]))
        return out


def swap_attention(model: nn.Module) -> list[str]:
    """Swap every CausalSDPA attention core of `model` (in place) for FP8Attention; returns their names. A core
    with attention dropout is refused (the FP8 kernel has none)."""
    names = []
    for name, m in list(model.named_modules()):
        if isinstance(m, CausalSDPA):
            if m.dropout:
                raise LowbitError(f"fp8_attention: {name} has attention dropout {m.dropout}; the FP8 attention has "
                                  f"none (set model.dropout 0)")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, FP8Attention(m.backend))
            names.append(name)
    return names


def unswap_attention(model: nn.Module) -> list[str]:
    """Undo `swap_attention`: every FP8Attention core back to the CausalSDPA it replaced; returns their names."""
    names = []
    for name, m in list(model.named_modules()):
        if isinstance(m, FP8Attention):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, CausalSDPA(m.backend))
            names.append(name)
    return names
