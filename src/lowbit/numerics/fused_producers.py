"""RMSNorm and SwiGLU that hand their FP8 output straight to the linears reading it (`numerics.fused_producers`).

Unfused, the attention and MLP norms and the SwiGLU product write a high-precision tensor that each
LowPrecisionLinear reading it then reads twice more (its amax, its cast). Here the producer computes the amax and
the cast itself (numerics.producers' kernels: the same formulas, the same bytes) and passes a `PrequantizedInput`
on: the linear takes those bytes and that cast's report, as if it had cast them. The attention norm's one FP8
copy serves wq, wk and wv alike, as their three identical casts would have (one scale per tensor, current:
`scale_from_amax` of the one amax). Where the linears' weight gradients read the input in FP8, the cast pass also
writes it transposed (the copy those GEMMs take, kept for backward instead of the row-major one): without it the
backward transposed the FP8 bytes in a copy of its own (on an H100, 23.5 ms of `clone_t` kernels in the compiled
`1b` step).

Backward is the unfused one: the model's own formulas (models.llama `rmsnorm_backward`, `silu_mul_backward`) on
the high-precision inputs, kept as the plain modules keep them (with their saved-activation codec, if any); each
linear's backward runs on the FP8 input as it does after its own cast.

Under delayed scaling (fp8-delayed, the fp8lm recipes' inputs) the producer reads the scale from the fed linears'
input ScalingState (the first's: they record the same reports, so they hold the same scale). SwiGLU then casts in
one pass, as TransformerEngine does, measuring the amax of what it writes, which the linears record; where the
state asks for the cast's own amax (`ScalingState.warming_up`: the first steps, after a bad amax) its amax pass
runs before, gated on the device (its kernel reads nothing otherwise), so no step waits for the host. The norm
keeps its amax pass, whose rstd its transposing cast needs. Either way the scale is `ScalingState.cast_scale`'s,
bit for bit.

Scope: LowPrecisionLinears whose input is one FP8 scale per tensor, current or delayed, without OCC, fed by
lowbit's Llama blocks (found by type); the plan refuses other recipes and tensor parallelism (an amax over one
rank's shard). `remove_fused_producers` puts the plain modules back (unconvert).
"""

from __future__ import annotations

import torch
from torch import nn

# importing producers registers the lowbit::rmsnorm_* and lowbit::swiglu_* ops called below
from lowbit.numerics import producers  # noqa: F401
from lowbit.models.llama import Block, RMSNorm, SwiGLU, rmsnorm_backward, silu_mul_backward
from lowbit.numerics.linear import LinearRecipe, LowPrecisionLinear, PrequantizedInput
from lowbit.numerics.scaling import Scaling, scale_from_amax
from lowbit.numerics.scaling_state import ScalingState, report

# which linears each producer of a lowbit Block feeds (names relative to the block)
FEEDS = {"attention_norm": ("attention.wq", "attention.wk", "attention.wv"),
         "ffn_norm": ("feed_forward.w1", "feed_forward.w3"),
         "feed_forward.act": ("feed_forward.w2",)}


def unsupported(r: LinearRecipe) -> str | None:
    """Why a linear of recipe `r` cannot take a prequantized input, or None if it can."""
    s = r.input
    if s.granularity != "tensor":
        return f"its input is scaled per {s.granularity}, not one scale per tensor"
    if s.strategy not in ("current", "delayed"):
        return f"its input has {s.strategy} scaling"
    if s.fmt not in ("e4m3", "e5m2"):
        return f"its input is {s.fmt}, not FP8"
    if r.occ is not None:
        return "its input is clamped (OCC)"
    return None


def _token(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The stand-in for an output that is never written: a zero expanded to its shape (no memory)."""
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _cast_report(amax: torch.Tensor, s: Scaling) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, report) of a current cast with this amax: ScalingState.cast_scale's, from the producer's amax."""
    scale, bad = scale_from_amax(amax, s)
    return scale, report(amax, bad)


def _delayed(state: ScalingState | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the scale a delayed state holds, whether it is warming up) for the Functions; (None, None): current."""
    return (None, None) if state is None else (state.scale, state.warming_up())


def _delayed_scale(past: torch.Tensor, warming: torch.Tensor, s: Scaling, amax: torch.Tensor) -> torch.Tensor:
    """ScalingState.cast_scale's delayed scale: `past`, or in warm-up the current one of the cast's `amax` (which
    may be measured only then: SwiGLU's gated amax pass)."""
    current, _ = scale_from_amax(amax, s, fallback=past)
    return torch.where(warming, current, past)


class _FP8RMSNorm(torch.autograd.Function):
    """RMSNorm(x)·w as FP8 (token, data, scale, report, and with `transpose` the data transposed); backward:
    models.llama's RMSNorm backward."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, s: Scaling, codec=None, transpose: bool = False, past=None,
                warming=None):
        x2 = x.reshape(-1, x.shape[-1])
        e5m2 = s.fmt == "e5m2"
        ops = torch.ops.lowbit
        with torch.autocast(x.device.type, enabled=False):
            # the amax pass, then the cast with its rstd, under either scaling (the transposing cast's tiles need
            # the rows' rstd; a one-pass kernel over whole rows took 124 us against these two passes' 103 on an
            # H100 at 16384 x 2048: BENCHMARKS.md)
            amax, rstd = ops.rmsnorm_amax(x2, weight, eps)
            scale, rep = _cast_report(amax, s)
            if s.strategy == "delayed":
                scale = _delayed_scale(past, warming, s, amax)
            data = ops.rmsnorm_cast_t(x2, weight, rstd, scale, e5m2) if transpose else \
                ops.rmsnorm_cast(x2, weight, eps, scale, e5m2, rstd)[:1]
        ctx.codec, ctx.x_dtype = codec, x.dtype
        ctx.save_for_backward(rstd.view(*x.shape[:-1], 1), weight, *(codec.pack(x) if codec else (x,)))
        ctx.mark_non_differentiable(*data, scale, rep)
        return _token(x.shape, torch.promote_types(weight.dtype, x.dtype), x.device), data[0], scale, rep, *data[1:]

    @staticmethod
    def backward(ctx, dy, *_):
        rstd, weight, *packed = ctx.saved_tensors
        x = ctx.codec.unpack(*packed, ctx.x_dtype) if ctx.codec else packed[0]
        dx, dw = rmsnorm_backward(dy, x, rstd, weight, *ctx.needs_input_grad[:2])
        return dx, dw, None, None, None, None, None, None


class _FP8SiluMul(torch.autograd.Function):
    """silu(a)·b as FP8 (token, data, scale, report, and with `transpose` the data transposed); backward:
    models.llama's SwiGLU backward."""

    @staticmethod
    def forward(ctx, a, b, s: Scaling, codec=None, transpose: bool = False, past=None, warming=None):
        a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
        e5m2, delayed = s.fmt == "e5m2", s.strategy == "delayed"
        ops = torch.ops.lowbit
        with torch.autocast(a.device.type, enabled=False):
            if delayed:  # one pass, measuring the amax
                scale = _delayed_scale(past, warming, s, ops.swiglu_amax(a2, b2, warming))
            else:
                scale, rep = _cast_report(ops.swiglu_amax(a2, b2), s)
            *data, amax = ops.swiglu_cast_t(a2, b2, scale, e5m2, delayed) if transpose else \
                ops.swiglu_cast(a2, b2, scale, e5m2, delayed)
            if delayed:  # the report of the amax it measured as it wrote
                rep = _cast_report(amax, s)[1]
        ctx.codec, ctx.dtypes = codec, (a.dtype, b.dtype)
        pa, pb = (codec.pack(a), codec.pack(b)) if codec else ((a,), (b,))
        ctx.n_a = len(pa)
        ctx.save_for_backward(*pa, *pb)
        ctx.mark_non_differentiable(*data, scale, rep)
        return _token(a.shape, torch.promote_types(a.dtype, b.dtype), a.device), data[0], scale, rep, *data[1:]

    @staticmethod
    def backward(ctx, dy, *_):
        saved, n = ctx.saved_tensors, ctx.n_a
        a, b = (ctx.codec.unpack(*saved[:n], ctx.dtypes[0]), ctx.codec.unpack(*saved[n:], ctx.dtypes[1])) \
            if ctx.codec else saved
        return (*silu_mul_backward(dy, a, b, *ctx.needs_input_grad[:2]), None, None, None, None, None)


def _prequantized(token, data, scale, rep, data_t=None) -> PrequantizedInput:
    return PrequantizedInput(token, data.reshape(-1, data.shape[-1]), scale, rep, data_t)


class _Producer:
    """What both producers keep: the fed linears' input Scaling, whether to write the transposed copy, and under
    delayed scaling the ScalingState that holds the scale (the first fed linear's; kept outside the module tree,
    so the state_dict stays the plain module's)."""

    def _producer_init(self, spec: Scaling, transpose: bool, state: ScalingState | None):
        if spec.strategy == "delayed" and state is None:
            raise ValueError("a producer scaled by delayed scaling needs the ScalingState of the linears it feeds")
        self.spec, self.transpose = spec, transpose
        self.__dict__["_state"] = state if spec.strategy == "delayed" else None

    def extra_repr(self) -> str:
        return f"output={self.spec.fmt}/tensor/{self.spec.strategy}{', transposed' if self.transpose else ''}"


class FP8RMSNorm(_Producer, RMSNorm):
    """An RMSNorm (same parameter, same state_dict) whose output is FP8 for the linears it feeds, cast as their
    input recipe `spec` says; with `transpose` (their weight gradients read it in FP8) also written transposed
    while gradients are on."""

    def __init__(self, norm: RMSNorm, spec: Scaling, transpose: bool = True, state: ScalingState | None = None):
        nn.Module.__init__(self)
        self.eps, self.weight, self.codec = norm.eps, norm.weight, norm.codec
        self._producer_init(spec, transpose, state)

    def forward(self, x: torch.Tensor) -> PrequantizedInput:
        grad = torch.is_grad_enabled()
        return _prequantized(*_FP8RMSNorm.apply(x.contiguous(), self.weight, self.eps, self.spec,
                                                self.codec if grad else None, self.transpose and grad,
                                                *_delayed(self._state)))

    def extra_repr(self) -> str:
        return f"eps={self.eps}, {_Producer.extra_repr(self)}"


class FP8SwiGLU(_Producer, SwiGLU):
    """SwiGLU whose product silu(a)·b is FP8 for the linear it feeds (w2)."""

    def __init__(self, act: SwiGLU, spec: Scaling, transpose: bool = True, state: ScalingState | None = None):
        nn.Module.__init__(self)
        self.codec = act.codec
        self._producer_init(spec, transpose, state)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> PrequantizedInput:
        grad = torch.is_grad_enabled()
        return _prequantized(*_FP8SiluMul.apply(a.contiguous(), b.contiguous(), self.spec,
                                                self.codec if grad else None, self.transpose and grad,
                                                *_delayed(self._state)))


def _fed_spec(block: nn.Module, names: tuple[str, ...]) -> tuple[Scaling | None, str | None]:
    """(the input Scaling all of `names` share, None) if each is a LowPrecisionLinear that takes a prequantized
    input, else (None, why not)."""
    linears = [block.get_submodule(n) for n in names]
    if not all(isinstance(m, LowPrecisionLinear) for m in linears):
        return None, "a linear it feeds stays high precision"
    device = linears[0].weight.device
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return None, "the producers' Triton kernels write FP8 from compute capability 8.9 on"
    why = next((w for w in (unsupported(m.recipe) for m in linears) if w), None)
    if why:
        return None, why
    if len({m.recipe.input for m in linears}) > 1:
        return None, "the linears it feeds scale their input differently"
    return linears[0].recipe.input, None


def install_fused_producers(model: nn.Module) -> dict[str, list[str]]:
    """Replace (in place) the norms and SwiGLU of each lowbit Llama Block that feed LowPrecisionLinears by their
    FP8 producers. Returns {"fused": [names], "unfused": ["name (why)"]}."""
    out = {"fused": [], "unfused": []}
    for name, block in model.named_modules():
        if not isinstance(block, Block):
            continue
        for child, names in FEEDS.items():
            spec, why = _fed_spec(block, names)
            full = f"{name}.{child}" if name else child
            if spec is None:
                out["unfused"].append(f"{full} ({why})")
                continue
            parent_name, _, attr = child.rpartition(".")
            parent = block.get_submodule(parent_name) if parent_name else block
            old = getattr(parent, attr)
            # their weight gradients read the input as FP8, transposed: the producer writes that copy too
            transpose = not any(block.get_submodule(n).recipe.wgrad_hp for n in names)
            state = block.get_submodule(names[0]).scaling["input"]
            setattr(parent, attr, (FP8RMSNorm if isinstance(old, RMSNorm) else FP8SwiGLU)(old, spec, transpose,
                                                                                          state))
            out["fused"].append(full)
    return out


def remove_fused_producers(model: nn.Module) -> None:
    """Put the plain RMSNorm and SwiGLU back (in place), sharing the parameters and codecs."""
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8RMSNorm):
            plain = RMSNorm(module.weight.shape[0], module.eps)
            plain.weight, plain.codec = module.weight, module.codec
        elif isinstance(module, FP8SwiGLU):
            plain = SwiGLU()
            plain.codec = module.codec
        else:
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
