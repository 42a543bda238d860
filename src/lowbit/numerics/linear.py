"""LowPrecisionLinear: an nn.Linear whose three GEMMs run in low precision.

    fprop  y  = x · Wᵀ      input (E4M3) x weight (E4M3)
    dgrad  dx = dy · W      grad_output (E5M2) x weight (E4M3)
    wgrad  dW = dyᵀ · x     grad_output (E5M2) x input (E4M3), or in high precision (`wgrad_hp`)

Each operand is quantized with the recipe's Scaling for it, along the reduction dimension of the GEMM it enters.
Eagerly, what is saved for backward is the quantized input (1 byte/element for FP8), not the high-precision one;
compiled, a tensorwise input is saved as it came and cast again in backward, which lets the compiler recompute it
instead of keeping it (`_keeps_input`). Where the backward needs an operand scaled along another dimension: the
weight is re-quantized from the parameter (kept anyway); the input, whose high-precision copy is gone, is
re-quantized from its dequantized value (tensor granularity needs neither: the transpose keeps the scale).
Eagerly on a GPU with one FP8 scale per tensor, where kernels.FUSED_TRANSPOSE is on (off for now: the kernel's
transposed copies were found wrong on an H100), the input, the weight and the output gradient are each cast and
transposed in one pass (`qtensor.cast_transpose`), and backward keeps the transposed input and weight (the bytes
its GEMMs read) instead of transposing them there.

The input may also arrive already quantized (`PrequantizedInput`, made by numerics.fused_producers: RMSNorm or
SwiGLU written directly as FP8): then the layer takes those bytes and that cast's report instead of casting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.numerics.fp4 import DGE, OCC, dge_factor, occ_dense, occ_fp8_mm, occ_mm, occ_split, occ_wgrad
from lowbit.numerics.gemm import scaled_matmul
from lowbit.numerics.qtensor import QTensor, cast, cast_transpose, quantize, transpose_fused
from lowbit.numerics.scaling import Scaling, all_max, expand_groups, group_amax, scale_from_amax
from lowbit.numerics.scaling_state import OperandStates, ScalingState, report

OPERANDS = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class LinearRecipe:
    """The numerics of one linear layer: a Scaling per operand."""

    input: Scaling = Scaling("e4m3")
    weight: Scaling = Scaling("e4m3")
    grad_output: Scaling = Scaling("e5m2")
    wgrad_hp: bool = False  # compute dW = dyᵀ·x in the autocast dtype instead of low precision
    fast_accum_fprop: bool = True  # fprop on GPU with fast FP8 accumulation (as torchao); dgrad/wgrad never
    dge: DGE | None = None  # FP4 weights: differentiable gradient estimator instead of straight-through
    occ: OCC | None = None  # outlier clamping of the input, the clamped part compensated unquantized


@dataclass
class PrequantizedInput:
    """A linear's input that its producer wrote directly as FP8 (numerics.fused_producers), with the scale a
    LowPrecisionLinear's tensorwise cast would pick, current or delayed (so the same bytes). `token` stands for the
    high-precision tensor that was never written: an expanded zero of its shape and dtype (no memory), the output
    of the producer's autograd Function, so that the linears' input gradients reach the producer's backward."""

    token: torch.Tensor  # [..., K]
    data: torch.Tensor  # [M, K] FP8
    scale: torch.Tensor  # [] the cast's scale
    report: torch.Tensor  # [2] ScalingState's report of the cast (amax, bad)
    data_t: torch.Tensor | None = None  # [K, M] FP8: data transposed (what the weight-gradient GEMM reads), if made

    @property
    def shape(self) -> torch.Size:
        return self.token.shape


def in_backward() -> bool:
    """True while autograd runs a backward pass: a forward replayed by activation checkpointing then must not
    record its amaxes a second time. (Under torch.compile the check is skipped: it would break the graph.)"""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def _keeps_input(r: LinearRecipe, clamped: bool) -> bool:
    """Whether backward gets the input itself (cast again there with the saved scale) instead of its FP8 copy.
    Compiled, with one scale per tensor: torch.compile's partitioner then recomputes the input from what other ops
    keep anyway (a norm's input, SwiGLU's w1/w3 outputs) instead of keeping a transposed FP8 copy per input.
    Eager, the FP8 copy is kept. Not with OCC (its clamped input is made from the input) nor other granularities
    (backward quantizes their input along another dimension, from the FP8 copy as eagerly)."""
    return torch.compiler.is_compiling() and not clamped and r.input.granularity == "tensor"


def _stats(x: torch.Tensor, q: QTensor) -> dict[str, float]:
    """Telemetry of one quantized operand: amax, scale, % of non-zeros flushed to zero, % saturated, SNR (dB)."""
    x = x.detach().float()
    deq = q.dequantize()
    scale = q.scale_inv.float().reciprocal()
    fmt = q.spec.format
    nonzero = x != 0
    n = max(x.numel(), 1)
    scaled = (x * expand_groups(scale, q.spec, x.shape)).abs()
    noise = (x - deq).pow(2).sum()
    signal = x.pow(2).sum()
    snr = 10 * math.log10(signal.item() / noise.item()) if noise.item() > 0 and signal.item() > 0 else None
    return {
        "amax": x.abs().amax().item(),
        "scale": scale.mean().item() if scale.numel() > 1 else scale.item(),
        "underflow_pct": 100.0 * ((deq == 0) & nonzero).sum().item() / max(nonzero.sum().item(), 1),
        "saturated_pct": 100.0 * (scaled > fmt.max).sum().item() / n,
        "snr_db": snr,
    }


class _LowPrecisionMatmul(torch.autograd.Function):
    """The three GEMMs. The input and weight scales arrive computed, with the reports of those casts (`reports`,
    [2, 2]: ScalingState.cast_scale). The output-gradient scale is chosen in backward from the state's scale and,
    delayed, its update count (read, never written) and dy's amax. When the forward records (`sink` given), the
    three reports go out as the gradient of `sink`, which the layer's states record outside the graph after the
    backward pass (OperandStates)."""

    @staticmethod
    def forward(ctx, x, weight, scale_x, scale_w, recipe: LinearRecipe, go_scale, go_warm, sink, reports,
                telemetry_layer, x_clamped=None, occ_idx=None, occ_val=None, go_group=None, x_data=None, x_data_t=None):
        r = recipe
        out_dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x2 = x.reshape(-1, x.shape[-1]) if x_clamped is None else x_clamped  # OCC: quantize the clamped input
        given = x_data is not None  # prequantized: x is PrequantizedInput's token, x_data its bytes
        ctx.hp = not given and _keeps_input(r, occ_idx is not None)
        # Eager on a GPU, one FP8 scale per tensor: the input and the weight cast and transposed in one pass each,
        # and backward keeps the transposed copies its GEMMs take (as many bytes as the row-major ones); a
        # prequantized input may come with its transpose (x_data_t, written by its producer in the same pass)
        ctx.xt = not r.wgrad_hp and (x_data_t is not None if given else
                                     not ctx.hp and transpose_fused(x2, r.input))
        ctx.wt = not hasattr(weight, "quantized") and transpose_fused(weight, r.weight)
        with torch.autocast(x.device.type, enabled=False):
            if given:
                qx = QTensor(x_data, scale_x.reciprocal(), r.input)
                qxt = QTensor(x_data_t, qx.scale_inv, r.input) if ctx.xt else None
            else:
                qx, qxt = cast_transpose(x2, r.input, scale_x) if ctx.xt else \
                    (quantize(x2, r.input, scale=scale_x), None)
            # a weight all-gathered in FP8 (FSDP2) arrives quantized with the whole tensor's scale
            if ctx.wt:
                qw, qwt = cast_transpose(weight, r.weight, scale_w)
            else:
                qw = weight.quantized() if hasattr(weight, "quantized") else quantize(weight, r.weight, scale=scale_w)
            y = scaled_matmul(qx, qw, out_dtype, fast_accum=r.fast_accum_fprop)
            if occ_idx is not None and r.occ.products != "sparse":  # OCC compensation ΔY·Wᵀ, ΔY dense
                delta = x.reshape(x2.shape).float() - x2.float()
                comp = occ_fp8_mm(delta, weight) if r.occ.products == "fp8" else \
                    (delta.to(out_dtype) @ weight.to(out_dtype).t()).float()  # in out_dtype
                y = (y.float() + comp).to(out_dtype)
            elif occ_idx is not None:  # sparse, in fp32
                y = (y.float() + occ_mm(occ_idx, occ_val, weight.float(), x2.shape[0])).to(out_dtype)
        if telemetry_layer is not None:
            if not given:  # a prequantized input's high-precision values were never written: no statistics
                telemetry_layer.telemetry["input"] = _stats(x2, qx)
            telemetry_layer.telemetry["weight"] = _stats(weight, qw)
        # OCC keeps its residual as C (index, value) pairs, about 2(1 − α)·12 bytes per input element.
        ctx.save_for_backward(x2 if ctx.hp else qxt.data if ctx.xt else qx.data, scale_x if ctx.hp else qx.scale_inv,
                              weight, go_scale, go_warm, qw.scale_inv, occ_idx, occ_val, reports)
        # A tensorwise FP8 weight is reused, transposed, by dgrad; other granularities re-quantize the parameter.
        ctx.qw = qwt if ctx.wt else qw if r.weight.granularity == "tensor" else None
        ctx.recipe, ctx.report, ctx.telemetry_layer, ctx.go_group = r, sink is not None, telemetry_layer, go_group
        # Compiled, dgrad writes out_dtype, as nn.Linear under autocast does: an fp32 input (a norm's output) gets its
        # gradient from a bf16 GEMM output, cast up inside the kernel that reads it (half the bytes of an fp32
        # output). Eagerly fp32: the cast would be a pass of its own.
        dx_dtype = out_dtype if torch.compiler.is_compiling() else x.dtype
        ctx.x_shape, ctx.x_dtype, ctx.dx_dtype = x.shape, x.dtype, dx_dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        kept, kept_scale, weight, go_scale, go_warm, w_scale_inv, occ_idx, occ_val, reports = ctx.saved_tensors
        r = ctx.recipe
        g = r.grad_output
        # the forward's FP8 input, made again from the kept input where that was kept (the same cast); its
        # transpose where forward kept that (ctx.xt: then only wgrad reads it, below)
        qx = QTensor(cast(kept, kept_scale, r.input), kept_scale.reciprocal(), r.input) if ctx.hp \
            else QTensor(kept, kept_scale, r.input)
        dy2 = dy.reshape(-1, dy.shape[-1])
        with torch.autocast(dy.device.type, enabled=False):
            amax = group_amax(dy2, g)
            if ctx.go_group is not None:  # dy is split over tensor-parallel ranks: the whole tensor's amax
                amax = all_max(amax, ctx.go_group)
            scale, bad = scale_from_amax(amax, g, fallback=go_scale if g.granularity == "tensor" else 1.0)
            if g.strategy == "delayed":  # the scale of past steps; in warm-up (ScalingState.warming_up), its own
                scale = torch.where(go_warm, scale, go_scale)
            fused = not r.wgrad_hp and transpose_fused(dy2, g)  # dy and dyᵀ in one pass
            qdy, qdyt = cast_transpose(dy2, g, scale) if fused else (quantize(dy2, g, scale=scale), None)
            if ctx.telemetry_layer is not None:
                ctx.telemetry_layer.telemetry["grad_output"] = _stats(dy2, qdy)
            # dgrad: dy [M, N] @ (Wᵀ [K, N])ᵀ
            if ctx.wt:  # kept transposed
                wt = ctx.qw
            else:
                wt = ctx.qw.t() if r.weight.granularity == "tensor" else quantize(weight.t(), r.weight)
            dx = scaled_matmul(qdy, wt, ctx.dx_dtype)
            # wgrad: dyᵀ [N, M] @ (xᵀ [K, M])ᵀ
            if r.wgrad_hp:
                dw = (dy2.t() @ qx.dequantize(dy.dtype)).to(weight.dtype)
            else:
                dyt = qdyt if fused else qdy.t() if g.granularity == "tensor" else quantize(dy2.t(), g)
                if ctx.xt:  # kept transposed
                    xt = QTensor(kept, kept_scale, r.input)
                elif r.input.granularity != "tensor":
                    xt = quantize(qx.dequantize().t(), r.input)
                elif ctx.hp:  # a cast of its own (not the forward's, transposed), so the partitioner does not
                    # make it in forward and keep it
                    xt = QTensor(cast(kept.t(), kept_scale, r.input), qx.scale_inv, r.input)
                else:
                    xt = qx.t()
                dw = scaled_matmul(dyt, xt, weight.dtype)
            if r.dge is not None:  # DGE: dL/dW = dL/dWq · f'(W scaled onto the grid)
                scaled = weight.float() / expand_groups(w_scale_inv.float(), r.weight, weight.shape)
                dw = (dw.float() * dge_factor(scaled, r.dge)).to(dw.dtype)
            if occ_idx is not None and r.occ.products != "sparse":  # the compensation's dW, dyᵀ·ΔY (no DGE)
                delta = occ_dense(occ_idx, occ_val, (dy2.shape[0], weight.shape[1]), dy2.dtype)
                comp = occ_fp8_mm(dy2.t(), delta.t(), "e5m2") if r.occ.products == "fp8" else dy2.t() @ delta
                dw = dw + comp.to(dw.dtype)  # fp8: dy in E5M2
            elif occ_idx is not None:
                dw = dw + occ_wgrad(occ_idx, occ_val, dy2, weight.shape[1]).t().to(dw.dtype)
        seen = torch.cat([reports, report(amax if g.granularity == "tensor" else None, bad)[None]]) \
            if ctx.report else None
        return (dx.reshape(ctx.x_shape).to(ctx.x_dtype), dw, None, None, None, None, None, seen, None, None, None,
                None, None, None, None, None)


def _scaling_states(recipe: LinearRecipe, device) -> OperandStates:
    return OperandStates({name: ScalingState(getattr(recipe, name)) for name in OPERANDS}).to(device)


class LowPrecisionLinear(nn.Linear):
    """Drop-in for nn.Linear (same parameters, same state_dict keys plus the scaling buffers)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, recipe: LinearRecipe = None,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe or LinearRecipe()
        self.scaling = _scaling_states(self.recipe, self.weight.device)
        self.telemetry_armed = False
        self.telemetry: dict[str, dict[str, float]] = {}

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: LinearRecipe) -> LowPrecisionLinear:
        """Wrap an existing nn.Linear, sharing its parameters."""
        new = cls(linear.in_features, linear.out_features, bias=False, recipe=recipe, device="meta")
        new.weight = linear.weight
        new.bias = linear.bias
        new.scaling = _scaling_states(recipe, linear.weight.device)
        return new

    def forward(self, x: torch.Tensor | PrequantizedInput) -> torch.Tensor:
        # not when activation checkpointing recomputes this forward: the original's backward reports its casts
        update = self.training and torch.is_grad_enabled() and not in_backward()
        r, st = self.recipe, self.scaling
        pre = x if isinstance(x, PrequantizedInput) else None
        if pre is not None:
            if st["input"].amax_group is not None:  # its amax is of this rank's shard only
                raise LowbitError("numerics.fused_producers: not with tensor parallelism (parallel.tp > 1)")
            x = pre.token
        x2, idx, val = x.reshape(-1, x.shape[-1]), None, None
        if r.occ is not None and r.occ.alpha < 1:  # clamp outliers; straight-through for x, the residual is
            x2, idx, val = occ_split(x2.detach(), r.occ)  # compensated in the Function (α = 1 clamps nothing)
        scale_x, report_x = (pre.scale, pre.report) if pre is not None else st["input"].cast_scale(x2)
        if hasattr(self.weight, "quantized"):  # FP8 all-gather (FSDP2): cast before the gather, reported here
            scale_w = self.weight._scale_inv.reciprocal()
            report_w = report(self.weight._amax, self.weight._bad)
        else:
            scale_w, report_w = st["weight"].cast_scale(self.weight)
        go = st["grad_output"]
        # Copies: the state may move on before this backward runs (another micro-batch's backward, a pipeline).
        # The reports are saved either way, so that a forward recomputed by activation checkpointing (which does
        # not record) saves as many tensors as the original.
        y = _LowPrecisionMatmul.apply(x, self.weight, scale_x, scale_w, r, go.scale.clone(),
                                      go.warming_up() if go.spec.strategy == "delayed" else None,
                                      st.sink(x.device) if update else None, torch.stack([report_x, report_w]),
                                      self if self.telemetry_armed else None, x2 if idx is not None else None, idx,
                                      val, go.amax_group, *((pre.data, pre.data_t) if pre is not None else ()))
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        r = self.recipe
        return (f"{self.in_features}, {self.out_features}, input={r.input.fmt}/{r.input.granularity}, "
                f"weight={r.weight.fmt}/{r.weight.granularity}, grad_output={r.grad_output.fmt}/"
                f"{r.grad_output.granularity}{', wgrad_hp' if r.wgrad_hp else ''}"
                f"{f', dge k={r.dge.k}' if r.dge else ''}{f', occ alpha={r.occ.alpha}' if r.occ else ''}")
