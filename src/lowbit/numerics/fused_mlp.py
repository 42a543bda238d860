"""The SwiGLU product and the linear that reads it (LLaMA's w2) as one autograd Function: silu(a)·b is written
directly as FP8 (`producers.swiglu_fp8`), never as a bf16 tensor, and the weight and the output gradient are cast
with their transposes (`qtensor.cast_transpose`: in one pass each where kernels.FUSED_TRANSPOSE is on).

Scope: one scale per tensor by current scaling (fp8-tensorwise's linears). Its casts are not recorded in w2's
scaling state (`ScalingState`: the last amax and scale, counters), and a bad amax of dy casts with scale 1 where
LowPrecisionLinear keeps the last good one; so `convert` does not use it: numerics.fused_producers feeds w2 the
same FP8 product through its LowPrecisionLinear instead, keeping its state. `lowbit bench kernels` times it
against that path (`mlp_fused`), and tests compare it with that path bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowbit.numerics.gemm import scaled_matmul
from lowbit.numerics.producers import swiglu_fp8
from lowbit.numerics.qtensor import QTensor, cast_transpose
from lowbit.numerics.scaling import current_scale


def supports(recipe) -> bool:
    """Whether `swiglu_linear` computes what a LowPrecisionLinear of `recipe` does: tensorwise current FP8 casts, no
    high-precision wgrad, DGE or OCC."""
    ops = (recipe.input, recipe.weight, recipe.grad_output)
    return (all(s.granularity == "tensor" and s.strategy == "current" and s.fmt in ("e4m3", "e5m2") and not s.margin
                and not s.power_of_two for s in ops) and not recipe.wgrad_hp and recipe.dge is None
            and recipe.occ is None)


class _SwiGLULinear(torch.autograd.Function):
    """y = (silu(a)·b) · Wᵀ with FP8 operands; backward: dgrad, wgrad, then SwiGLU's backward from dh."""

    @staticmethod
    def forward(ctx, a, b, weight, recipe):
        r = recipe
        out_dtype = torch.get_autocast_dtype(a.device.type) if torch.is_autocast_enabled(a.device.type) else a.dtype
        with torch.autocast(a.device.type, enabled=False):
            qh, _ = swiglu_fp8(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), r.input)
            qw, qwt = cast_transpose(weight, r.weight, current_scale(weight, r.weight)[0])
            y = scaled_matmul(qh, qw, out_dtype, fast_accum=r.fast_accum_fprop)
        ctx.save_for_backward(a, b, qh.data, qh.scale_inv, qwt.data, qwt.scale_inv)
        ctx.recipe, ctx.w_dtype = r, weight.dtype
        return y.reshape(*a.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        a, b, h8, h_inv, wt8, w_inv = ctx.saved_tensors
        r = ctx.recipe
        dy2 = dy.reshape(-1, dy.shape[-1])
        with torch.autocast(dy.device.type, enabled=False):
            qdy, qdyt = cast_transpose(dy2, r.grad_output, current_scale(dy2, r.grad_output)[0])
            dh = scaled_matmul(qdy, QTensor(wt8, w_inv, r.weight), a.dtype).reshape(a.shape)
            dw = scaled_matmul(qdyt, QTensor(h8, h_inv, r.input).t(), ctx.w_dtype)
        # SwiGLU's backward as models/llama.py's _SiluMul: each product cast to its input's dtype
        da = torch.ops.aten.silu_backward((dh * b).to(a.dtype), a)
        db = (dh * F.silu(a)).to(b.dtype)
        return da, db, dw, None


def swiglu_linear(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, recipe) -> torch.Tensor:
    """(silu(a)·b) · weightᵀ under `recipe` (a LinearRecipe that `supports` allows), the product never in bf16."""
    return _SwiGLULinear.apply(a, b, weight, recipe)
