"""The fused quantization kernels' custom ops and their callers on the CPU: each op's CPU kernel is the torch formula,
torch.compile keeps the op as one call, and the layers that call it compute what the unfused path does, bit for bit.
(The Triton kernels themselves are compared with the same formulas on a GPU: tests/test_gpu.py.)"""

import torch

import lowbit.numerics.linear as linear_mod
import lowbit.numerics.qtensor as qtensor_mod
from lowbit.numerics.qtensor import FP8, cast
from lowbit.numerics.recipes import convert, get_recipe
from lowbit.numerics.scaling import Scaling


def test_cast_transpose_op_is_the_cast_and_its_transpose_and_compiles_as_one_call():
    torch.manual_seed(0)
    x = torch.randn(96, 80, dtype=torch.bfloat16) * 5
    scale = torch.tensor(30.0)
    for fmt in ("e4m3", "e5m2"):
        y, yt, amax = torch.ops.lowbit.cast_transpose(x, scale, fmt == "e5m2", True)
        want = cast(x, scale, Scaling(fmt))
        assert torch.equal(y.view(torch.uint8), want.view(torch.uint8)) and y.dtype == want.dtype
        assert torch.equal(yt.view(torch.uint8), want.t().contiguous().view(torch.uint8)) and yt.is_contiguous()
        assert amax == x.abs().amax().float()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda t, s: torch.ops.lowbit.cast_transpose(t * 2, s, False, False), backend=backend,
                       fullgraph=True)
    y, yt, _ = fn(x, scale)
    assert "lowbit.cast_transpose" in graphs[0].code
    assert torch.equal(yt.view(torch.uint8), cast(x * 2, scale, Scaling("e4m3")).t().contiguous().view(torch.uint8))


def test_linear_with_fused_cast_transpose_matches_the_unfused_path_bit_for_bit(monkeypatch):
    """The GPU's fused path run on the CPU (its op's CPU kernel standing in for the Triton one): x, W and dy each
    cast and transposed by the op, backward taking the kept transposes; y, dx and dW are the unfused path's bits."""
    calls = []
    real = torch.ops.lowbit.cast_transpose

    def run(fused, recipe):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32, bias=False))
        convert(m, get_recipe(recipe))
        x = torch.randn(3, 48, 64, requires_grad=True)
        on = (lambda t, s: t.dim() == 2 and s.granularity == "tensor" and s.format.torch_dtype in FP8) if fused \
            else (lambda t, s: False)
        monkeypatch.setattr(linear_mod, "transpose_fused", on)
        monkeypatch.setattr(qtensor_mod, "transpose_fused", on)
        y = m(x)
        y.pow(2).mean().backward()
        return [y.detach(), x.grad] + [p.grad for p in m.parameters()]

    monkeypatch.setattr(torch.ops.lowbit, "cast_transpose", lambda *a: calls.append(a[0].shape) or real(*a))
    for recipe in ("fp8-tensorwise", "fp8-delayed"):
        calls.clear()
        plain = run(False, recipe)
        assert not calls
        fused = run(True, recipe)
        assert len(calls) == 6, calls  # x, W and dy of each layer
        assert all(torch.equal(a, b) for a, b in zip(plain, fused)), recipe


def test_fused_producers_on_the_cpu_are_the_unfused_path_bit_for_bit():
    """swiglu_fp8 / rmsnorm_fp8 (their ops' CPU kernels: the torch formulas) against the model's formula, then
    lowbit's quantize: current scaling (amax pass, then the cast) and a given scale (one pass, with the amax)."""
    import torch.nn.functional as F

    from lowbit.numerics.producers import rmsnorm_fp8, swiglu_fp8
    from lowbit.numerics.qtensor import quantize

    torch.manual_seed(0)
    a, b = (torch.randn(64, 96, dtype=torch.bfloat16) * 3 for _ in range(2))
    x, w = torch.randn(64, 80, dtype=torch.bfloat16) * 2, torch.rand(80) + 0.5
    h_norm = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    for fmt in ("e4m3", "e5m2"):
        s = Scaling(fmt)
        for got, h in ((swiglu_fp8(a, b, s), F.silu(a) * b), (rmsnorm_fp8(x, w, 1e-5, s), h_norm)):
            q, amax = got[0], got[-1]
            want = quantize(h, s)
            assert torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
            assert torch.equal(q.scale_inv, want.scale_inv) and amax == h.abs().amax().float()
        scale = torch.tensor(3.0)
        q, amax = swiglu_fp8(a, b, s, scale)
        assert torch.equal(q.data.view(torch.uint8), cast(F.silu(a) * b, scale, s).view(torch.uint8))
        assert amax == (F.silu(a) * b).abs().amax().float()
        q, rstd, _ = rmsnorm_fp8(x, w, 1e-5, s, scale)
        assert torch.equal(q.data.view(torch.uint8), cast(h_norm, scale, s).view(torch.uint8))
        assert torch.equal(rstd, torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5))
    graphs = []
    fn = torch.compile(lambda a, b: swiglu_fp8(a, b, Scaling("e4m3"))[0].data, fullgraph=True,
                       backend=lambda gm, ex: graphs.append(gm) or gm.forward)
    fn(a, b)
    assert "lowbit.swiglu_amax" in graphs[0].code and "lowbit.swiglu_cast" in graphs[0].code


def test_swiglu_linear_is_the_unfused_mlp_tail_bit_for_bit():
    """silu(a)·b written as FP8 and fed to w2 in one Function: y and the gradients of a, b and W are those of the
    model's SwiGLU followed by a LowPrecisionLinear of fp8-tensorwise (on the CPU: the ops' torch formulas)."""
    from lowbit.models.llama import SwiGLU
    from lowbit.numerics.fused_mlp import supports, swiglu_linear
    from lowbit.numerics.linear import LowPrecisionLinear

    recipe = get_recipe("fp8-tensorwise").linear
    assert supports(recipe) and not supports(get_recipe("fp8-delayed").linear)
    torch.manual_seed(0)
    w2 = LowPrecisionLinear.from_linear(torch.nn.Linear(96, 64, bias=False), recipe)
    a0, b0 = torch.randn(2, 24, 96) * 2, torch.randn(2, 24, 96)
    dy = torch.randn(2, 24, 64)
    out = []
    for fused in (False, True):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        w2.weight.grad = None
        y = swiglu_linear(a, b, w2.weight, recipe) if fused else w2(SwiGLU()(a, b))
        y.backward(dy)
        out.append([y.detach(), a.grad, b.grad, w2.weight.grad])
    assert all(torch.equal(u, f) for u, f in zip(*out))


def test_cast_kernels_build_for_hopper_without_the_one_instruction_clamp():
    """kernels.py's casts build through ptxas for sm90, from bf16 and fp32, at sizes that are multiples of 16 and
    not (Triton's specializations), and clamp by min and max: not by the one NaN-keeping instruction (`xorsign`)
    they used when the transposed copies were found wrong on an H100 (kernels.FUSED_TRANSPOSE). No GPU needed."""
    import pytest

    from conftest import build_for_hopper
    from lowbit.numerics import kernels

    if kernels.triton is None:
        pytest.skip("needs Triton")
    for src in ("*bf16", "*fp32"):
        cases = [(kernels._cast_transpose_kernel, [src, "*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32", "i32", "i32"],
                  dict(FMT_MAX=448.0, AMAX=False, BM=128, BN=128), ("M", "N")),
                 (kernels._cast_kernel, [src, "*fp8e5", "*fp32", "*fp32", "*fp32", "i32"],
                  dict(FMT_MAX=57344.0, FROM_STATS=False, BLOCK=4096, REVERSE=True), ("n",))]
        for fn, types, constants, sizes in cases:
            for aligned in (True, False):
                built = build_for_hopper(fn, types, constants, divisible=sizes if aligned else ())
                assert built.asm["cubin"] and "xorsign" not in built.asm["ptx"] and "min.f32" in built.asm["ptx"]
