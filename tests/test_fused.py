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
