"""FP4 training: DGE, OCC, FP4 linears on FP8 storage, recipes and their errors."""

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.numerics.fp4 import (DGE, OCC, abs_quantile, dge_factor, dge_surrogate, occ_capacity, occ_mm, occ_residual,
                        occ_split, occ_wgrad)
from lowbit.numerics.formats import FORMATS

GRID = FORMATS["e2m1"]


def _points():
    """Scaled weights in [-6, 6], away from interval edges and midpoints (where f is not differentiable)."""
    x = torch.linspace(-5.97, 5.97, 4001, dtype=torch.float64)
    a = x.abs()
    delta = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    base = torch.where(a < 2, 0.0, torch.where(a < 4, 2.0, 4.0))
    u = torch.remainder(a - base, delta) / delta
    keep = ((u - 0.5).abs() > 0.02) & (u > 0.02) & (u < 0.98)
    return x[keep]


def test_dge_derivative_matches_closed_form_and_finite_differences():
    x = _points()
    for k in (2.0, 5.0):
        h = 1e-6
        fd = (dge_surrogate(x + h, k) - dge_surrogate(x - h, k)) / (2 * h)
        got = dge_factor(x, DGE(k=k, clamp=1e9))
        torch.testing.assert_close(got, fd, rtol=1e-4, atol=1e-6)
        delta = torch.where(x.abs() < 2, 0.5, torch.where(x.abs() < 4, 1.0, 2.0))
        base = torch.where(x.abs() < 2, 0.0, torch.where(x.abs() < 4, 2.0, 4.0))
        t = (2 * torch.remainder(x.abs() - base, delta) / delta - 1).abs()
        torch.testing.assert_close(got, (1 / k) * t ** (1 / k - 1))  # the closed form, written out
    assert dge_factor(torch.tensor([0.25]), DGE()).item() == 3.0  # mid-interval: the clamp (default 3)
    assert dge_factor(torch.tensor([0.0]), DGE()).item() == pytest.approx(0.2)  # on the grid: 1/k


def test_dge_k_of_1_trains_as_straight_through():
    """numerics.dge_k reaches the run's recipe, and fp4 with k = 1 computes fp4-no-dge's weight gradient bit for
    bit."""
    from torch import nn

    from lowbit.numerics.recipes import convert, get_recipe, with_dge
    from lowbit.train.plan import load_config
    from lowbit.train.plan import resolve_recipe as recipe_of

    got = recipe_of(load_config(None, ["--recipe", "fp4", "--numerics.dge_k", "2", "--numerics.dge_clamp", "1.5"]))
    assert got.linear.dge == DGE(k=2.0, clamp=1.5)
    assert recipe_of(load_config(None, ["--recipe", "fp4"])).linear.dge == DGE()

    g = torch.Generator().manual_seed(0)
    x, up = torch.randn(64, 128, generator=g), torch.randn(64, 32, generator=g)
    grads = []
    for recipe in (with_dge(get_recipe("fp4"), k=1.0), get_recipe("fp4-no-dge"), get_recipe("fp4")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(128, 32, bias=False))
        convert(model, recipe)
        model(x).backward(up)
        grads.append(model[0].weight.grad)
    assert torch.equal(grads[0], grads[1]) and not torch.equal(grads[0], grads[2])
    with pytest.raises(LowbitError, match="no DGE"):
        with_dge(get_recipe("fp8-tensorwise"), clamp=2.0)


def test_dge_limits_straight_through_and_hard_quantizer():
    x = _points()
    torch.testing.assert_close(dge_surrogate(x, 1.0), x)  # k = 1: f is the identity, f' = 1: straight-through
    assert torch.equal(dge_factor(x, DGE(k=1.0)), torch.ones_like(x))
    far = dge_surrogate(x, 200.0)  # large k: f tends to the quantizer itself (round to nearest)
    assert (far - GRID.quantize(x.float()).double()).abs().max() < 0.05


def _layer(occ, dge, weight):
    from lowbit.numerics.linear import LinearRecipe, LowPrecisionLinear
    from lowbit.numerics.scaling import Scaling

    r = LinearRecipe(Scaling("e2m1", "row"), Scaling("e2m1", "row"), Scaling("e4m3", "row"), dge=dge, occ=occ)
    layer = LowPrecisionLinear.from_linear(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False), r)
    layer.weight.data.copy_(weight)
    return layer


@pytest.mark.parametrize("products", ["dense", "sparse"])
def test_fp4_forward_and_backward_against_a_reference(products):
    """y = Q(clamp x)·Q(W)ᵀ + ΔY·Wᵀ; dx straight-through (as without OCC); dW = (quantized-path wgrad)·f' + dyᵀ·ΔY,
    with OCC's products dense or sparse (fp32 here: both are the same math)."""
    from lowbit.numerics.gemm import scaled_matmul
    from lowbit.numerics.qtensor import quantize
    from lowbit.numerics.scaling import Scaling, expand_groups

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=g)
    x[:, 7] *= 30  # an outlier channel
    w = torch.randn(32, 128, generator=g) * 0.05
    up = torch.randn(64, 32, generator=g)  # dL/dy
    out = {}
    for occ in (None, OCC(0.99, "exact", products)):
        for dge in (None, DGE()):
            layer, xi = _layer(occ, dge, w), x.clone().requires_grad_()
            y = layer(xi)
            y.backward(up)
            out[occ is not None, dge is not None] = (y.detach(), xi.grad, layer.weight.grad)
    q = abs_quantile(x, 0.99, "exact")  # the reference is dense: a dropped or wrong compensation shows
    clamped = x.clamp(-q, q)
    dense = x - clamped
    f4, g8 = Scaling("e2m1", "row"), Scaling("e4m3", "row")
    qx, qw = quantize(clamped, f4), quantize(w, f4)
    torch.testing.assert_close(out[True, False][0], scaled_matmul(qx, qw) + dense @ w.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[True, True][1], out[False, False][1])  # dx: neither OCC nor DGE touches it
    wgrad = scaled_matmul(quantize(up.t(), g8), quantize(qx.dequantize().t(), f4))
    torch.testing.assert_close(out[True, False][2], wgrad + up.t() @ dense, rtol=1e-5, atol=1e-5)
    factor = dge_factor(w / expand_groups(qw.scale_inv, f4, w.shape), DGE())
    torch.testing.assert_close(out[True, True][2], wgrad * factor + up.t() @ dense, rtol=1e-5, atol=1e-5)
    ratio = out[False, True][2] / out[False, False][2]
    assert ratio.min() >= 0.2 - 1e-6 and ratio.max() <= 3 + 1e-6 and ratio.std() > 0.1


def test_dense_products_under_bf16_autocast_match_the_fp32_sparse_ones_to_bf16_rounding():
    """Under autocast the dense products run in bf16 (ΔY and W rounded to bf16, as the bf16 baseline computes
    x·Wᵀ); they differ from the fp32 sparse products by bf16 rounding only."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) / torch.rand(256, 128, generator=g).clamp(min=0.05)
    w = torch.randn(64, 128, generator=g) * 0.05
    up = torch.randn(256, 64, generator=g)
    got = {}
    for products in ("dense", "sparse"):
        layer, xi = _layer(OCC(0.99, "exact", products), DGE(), w), x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(xi)
        y.float().backward(up.to(y.dtype))
        got[products] = (y.float(), layer.weight.grad)
    for a, b in zip(got["dense"], got["sparse"]):
        assert (a - b).abs().max().item() <= 2 ** -7 * b.abs().max().item()


def _e4m3_per_tensor(t: torch.Tensor, fmt=torch.float8_e4m3fn, fmax=448.0) -> torch.Tensor:
    # the value an FP8 operand carries: one current scale per tensor (fmax / amax), round to nearest even
    scale = fmax / t.abs().amax().float()
    return (t.float() * scale).clamp(-fmax, fmax).to(fmt).float() / scale


def test_fp8_products_are_the_dense_products_through_fp8_operands():
    """products = "fp8": the compensation terms ΔY·Wᵀ and dyᵀ·ΔY computed from E4M3 ΔY and W and E5M2 dy (one
    scale per tensor each), fp32 sums; within FP8's rounding of the exact products, which are a real part of y."""
    from lowbit.numerics.gemm import scaled_matmul
    from lowbit.numerics.qtensor import quantize
    from lowbit.numerics.scaling import Scaling
    from lowbit.train.plan import load_config, resolve_recipe

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) / torch.rand(256, 128, generator=g).clamp(min=0.05)  # heavy tails
    w = torch.randn(64, 128, generator=g) * 0.05
    up = torch.randn(256, 64, generator=g)
    got = resolve_recipe(load_config(None, ["--recipe", "fp4", "--numerics.occ_products", "fp8"])).linear.occ
    assert got.products == "fp8" and resolve_recipe(load_config(None, ["--recipe", "fp4"])).linear.occ.products == \
        "dense"
    layer, xi = _layer(OCC(0.99, "exact", "fp8"), None, w), x.clone().requires_grad_()
    y = layer(xi)
    y.backward(up)
    q = abs_quantile(x, 0.99, "exact")
    clamped = x.clamp(-q, q)
    dense = x - clamped
    f4, g8 = Scaling("e2m1", "row"), Scaling("e4m3", "row")
    qx = quantize(clamped, f4)
    main = scaled_matmul(qx, quantize(w, f4))
    comp = _e4m3_per_tensor(dense) @ _e4m3_per_tensor(w).t()
    torch.testing.assert_close(y.detach(), main + comp, rtol=1e-5, atol=1e-5)
    exact = dense @ w.t()
    assert (comp - exact).norm() < 2 ** -3 * exact.norm() and (comp - exact).norm() > 0  # FP8's rounding, no more
    wgrad = scaled_matmul(quantize(up.t(), g8), quantize(qx.dequantize().t(), f4))
    comp_w = _e4m3_per_tensor(up.t(), torch.float8_e5m2, 57344.0) @ _e4m3_per_tensor(dense.t()).t()
    torch.testing.assert_close(layer.weight.grad, wgrad + comp_w, rtol=1e-5, atol=1e-5)
    exact_w = up.t() @ dense
    assert (comp_w - exact_w).norm() < 2 ** -2 * exact_w.norm()


def test_sampled_quantile_sees_every_channel():
    g = torch.Generator().manual_seed(0)
    for channels in ([5, 77, 301], [0, 32, 64, 96]):  # off and on any power-of-two stride
        x = torch.randn(2048, 1024, generator=g)
        x[:, channels] *= 30
        for method in ("exact", "sample"):
            q = abs_quantile(x, 0.99, method)
            clamped = (x.abs() > q).float().mean().item()
            assert 0.007 < clamped < 0.013, (channels, method, clamped)


def test_occ_residual_is_compact_and_equals_the_dense_computation():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 256, generator=g) / torch.rand(512, 256, generator=g).clamp(min=0.05)  # heavy tails
    w = torch.randn(128, 256, generator=g)
    dy = torch.randn(512, 128, generator=g)
    for alpha in (0.999, 0.99, 0.97):
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            clamped, idx, val = occ_split(xd, OCC(alpha, "exact"))
            q = abs_quantile(xd, alpha, "exact").to(dtype)
            assert torch.equal(clamped, xd.clamp(-q, q))  # no overflow: the quantile's clamp
            assert idx.shape == val.shape == (occ_capacity(x.numel(), alpha),) and val.dtype == torch.float32
            residual = occ_residual(idx, val, x.shape)
            assert abs(residual._nnz() / x.numel() - (1 - alpha)) < 0.1 * (1 - alpha) + 1e-3
            dense = xd.float() - clamped.float()
            assert torch.equal(residual.to_dense(), dense)
            torch.testing.assert_close(occ_mm(idx, val, w, x.shape[0]), dense @ w.t(), rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(occ_wgrad(idx, val, dy, x.shape[1]), dense.t() @ dy, rtol=1e-5, atol=1e-4)


def test_occ_overflow_raises_the_clamp_by_powers_of_two_until_the_outliers_fit():
    """More outliers than the C slots: the threshold is the first of q·2, q·4, ... that at most C exceed; those
    are the residual, the rest is clamped there, and the split stays exact."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 128, generator=g)
    x[1::2][torch.rand(512, 128, generator=g) < 0.1] *= 100  # 5% outliers, all in tokens the sample skips
    clamped, idx, val = occ_split(x, OCC(0.99))
    c, q = occ_capacity(x.numel(), 0.99), abs_quantile(x, 0.99)  # C: 2%
    t = clamped.abs().max()
    j = torch.log2(t / q).item()
    assert j == round(j) and 1 <= j <= 8, j  # raised, by a power of two
    a = x.abs().flatten()
    assert (a > t).sum() <= c < (a > t / 2).sum()  # the first that fits
    assert torch.equal(idx[val != 0], (a > t).nonzero().squeeze(1)) and (val != 0).sum() == (a > t).sum()
    assert torch.equal(occ_residual(idx, val, x.shape).to_dense(), x - clamped)  # still a split of x
    w = torch.randn(64, 128, generator=g) * 0.05
    y = _layer(OCC(0.99), None, w)(x)
    ref = _layer(None, None, w)(clamped) + (x - clamped) @ w.t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


def test_occ_without_room_below_the_maximum_clamps_nothing():
    """A zero quantile (the sample sees only zeros) with more non-zeros than slots: no multiple of q fits, so the
    threshold is max |x| and the layer is plain FP4 of the whole x."""
    x = torch.zeros(4096, 64)
    x[1:492:4] = torch.randn(123, 64, generator=torch.Generator().manual_seed(1))  # 3% non-zero, C is 2%
    assert abs_quantile(x, 0.99) == 0
    clamped, idx, val = occ_split(x, OCC(0.99))
    assert torch.equal(clamped, x) and not val.any()


def test_occ_ops_pass_opcheck():
    """Schema, fake (meta) kernels and the static output shapes torch.compile relies on."""
    x = torch.randn(64, 32) / torch.rand(64, 32).clamp(min=0.05)
    idx, val = occ_split(x, OCC(0.99))[1:]
    for op, args in [(torch.ops.lowbit.occ_mm, (idx, val, torch.randn(16, 32), 64)),
                     (torch.ops.lowbit.occ_wgrad, (idx, val, torch.randn(64, 16), 32))]:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_sampled_quantile_is_close():
    x = torch.randn(1 << 21, generator=torch.Generator().manual_seed(0))
    exact, sampled = abs_quantile(x, 0.99, "exact"), abs_quantile(x, 0.99, "sample")
    assert exact.item() == pytest.approx(torch.quantile(x.abs()[: 1 << 24], 0.99).item(), rel=1e-4)
    assert abs(sampled.item() - exact.item()) / exact.item() < 0.01


def test_occ_fidelity_table():
    """The committed script's table: compensation improves every metric over clamping alone, and OCC with alpha
    above every value is plain FP4."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from occ_fidelity import student_t, table

    x = student_t(512, 256)
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)) * 0.02
    rows = {r["case"]: r for r in table(x, w)}
    for part in ("activation", "output"):
        clamp, comp = rows["clamp 0.999"][part], rows["clamp 0.999 + comp"][part]
        assert comp["cos"] > clamp["cos"] and comp["mse"] < clamp["mse"] and comp["snr_db"] > clamp["snr_db"]
        assert rows["clamp 0.99 + comp"][part]["snr_db"] > rows["no clamp"][part]["snr_db"]
    from lowbit.numerics.linear import LinearRecipe, LowPrecisionLinear
    from lowbit.numerics.scaling import Scaling

    r = LinearRecipe(Scaling("e2m1", "row"), Scaling("e2m1", "row"), Scaling("e4m3", "row"))
    plain = LowPrecisionLinear.from_linear(torch.nn.Linear(256, 64, bias=False), r)
    occ = LowPrecisionLinear.from_linear(plain, LinearRecipe(r.input, r.weight, r.grad_output, occ=OCC(1.0)))
    occ.weight = plain.weight
    assert torch.equal(plain(x), occ(x))


def test_fp4_gemm_runs_on_fp8_storage_and_matches_emulation():
    from lowbit.numerics.gemm import fast_path_reason, scaled_matmul
    from lowbit.numerics.qtensor import quantize
    from lowbit.numerics.scaling import Scaling

    g = torch.Generator().manual_seed(0)
    a, b = quantize(torch.randn(64, 128, generator=g), Scaling("e2m1", "row")), \
        quantize(torch.randn(32, 128, generator=g), Scaling("e2m1", "row"))
    assert a.data.dtype == torch.float8_e4m3fn  # E2M1 values held exactly as E4M3 bytes
    assert set(a.data.float().abs().unique().tolist()) <= {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    emulated = a.dequantize() @ b.dequantize().t()
    torch.testing.assert_close(scaled_matmul(a, b), emulated, rtol=1e-5, atol=1e-5)
    from lowbit.numerics.gemm import _cpu_rowwise_supported

    assert (fast_path_reason(a, b, torch.float32) is None) == _cpu_rowwise_supported()


def test_fp4_bad_input():
    with pytest.raises(LowbitError, match="alpha"):
        OCC(0.0)
    with pytest.raises(LowbitError, match="alpha"):
        OCC(1.5)
    with pytest.raises(LowbitError, match="k must be > 0"):
        DGE(k=0)
    from lowbit.numerics.recipes import convert, get_recipe

    model = torch.nn.Sequential(torch.nn.Linear(64, 33))
    with pytest.raises(LowbitError, match="FP4 on 0: 64 -> 33"):
        convert(model, get_recipe("fp4"))


@pytest.mark.parametrize("recipe", ["fp4-no-dge", "fp4-no-occ", "fp4-weights-only"])
@pytest.mark.slow
def test_fp4_ablations_train(recipe, tmp_path, capsys):
    import math

    from conftest import SMALL, cli, losses

    code, _, err = cli(capsys, "train", *SMALL, "--recipe", recipe, "--train.steps", "6", "--train.lr", "1e-2",
                         "--run.dir", tmp_path)
    assert code == 0, err
    run = losses(tmp_path)
    assert all(math.isfinite(v) for v in run.values()) and run[6] < run[1]
