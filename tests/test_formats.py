"""lowbit.numerics.formats against ml_dtypes (the reference for every format) and torch's own float8 casts."""

import functools
import math

import numpy as np
import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.numerics.formats import FORMATS, FloatFormat, get_format, pack_fp4, unpack_fp4

ml_dtypes = pytest.importorskip("ml_dtypes")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn,
      "e3m2": ml_dtypes.float6_e3m2fn, "e2m3": ml_dtypes.float6_e2m3fn, "e8m0": ml_dtypes.float8_e8m0fnu}
NAMES = list(FORMATS)
SIGNED = [n for n in NAMES if FORMATS[n].signed]


def ml_cast(x: np.ndarray, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):  # ml_dtypes warns on overflow, which is what we are testing
        return x.astype(ML[name]).astype(np.float32)


def q(name: str, x: np.ndarray, **kw) -> np.ndarray:
    return FORMATS[name].quantize(torch.from_numpy(np.ascontiguousarray(x, np.float32)), **kw).numpy()


def assert_same_bits(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> None:
    """Bit-for-bit equality (so -0.0 != 0.0), NaN compared by position only."""
    gn, wn = np.isnan(got), np.isnan(want)
    bad = (gn != wn) | (~gn & (got.view(np.int32) != want.view(np.int32)))
    idx = np.flatnonzero(bad)[:5]
    assert not bad.any(), (f"{bad.sum()} mismatches, e.g. x={x[idx].tolist()} "
                           f"got={got[idx].tolist()} want={want[idx].tolist()}")


def edge_values(fmt: FloatFormat) -> np.ndarray:
    """Ties between neighbours (odd and even), the overflow threshold, subnormal edges, specials; +-1 ulp each."""
    g = fmt.grid().double().numpy()
    step = g[-1] - g[-2]
    points = [g, (g[:-1] + g[1:]) / 2, [g[-1] + step / 2, g[-1] + step, 2 * g[-1]]]  # midpoints are exact in fp32
    if fmt.name == "e8m0":
        points.append(1.5 * g)  # E8M0 rounds in the linear domain: 1.5 * 2^k is its tie
    tiny = np.array([fmt.min_subnormal / 2, fmt.min_subnormal * 1.5, fmt.min_normal / 2, 2.0**-126, 2.0**-127,
                     1.5 * 2.0**-127, 2.0**-149, 0.0])
    with np.errstate(over="ignore"):  # E8M0's 1.5 * 2^127 and 2 * max are past fp32: Inf, also wanted
        pts = np.concatenate([np.asarray(p, np.float64) for p in points] + [tiny]).astype(np.float32)
    pts = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    specials = np.array([np.inf, -np.inf, np.nan, -np.nan, np.finfo(np.float32).max], np.float32)
    return np.concatenate([pts, -pts, specials]).astype(np.float32)


@functools.lru_cache(maxsize=None)
def mixture(name: str, n: int = 1_000_000) -> np.ndarray:
    """n fp32 values: normals at scales from below the smallest subnormal to past max, raw bit patterns, edges."""
    fmt = FORMATS[name]
    rng = np.random.default_rng(NAMES.index(name))
    lo = math.log2(fmt.min_subnormal or fmt.min_normal) - 4
    hi = min(math.log2(fmt.max) + 4, 126)
    scales = 2.0 ** np.linspace(lo, hi, 24)
    per = (n * 7 // 10) // len(scales)
    with np.errstate(over="ignore"):  # the widest E8M0 scales overflow fp32 to Inf on purpose
        normals = np.concatenate([rng.normal(0.0, s, per) for s in scales]).astype(np.float32)
    if not fmt.signed:
        normals = np.abs(normals)  # E8M0 only takes positive values; negatives still come from the bit patterns
    edges = edge_values(fmt)
    bits = rng.integers(0, 2**32, n - len(normals) - len(edges), dtype=np.uint32).view(np.float32)
    return np.concatenate([normals, bits, edges])


# ---------------------------------------------------------------- constants and codes


@pytest.mark.parametrize("name", NAMES)
def test_constants_match_ml_dtypes(name):
    fmt, fi = FORMATS[name], ml_dtypes.finfo(ML[name])
    assert fmt.name == name and get_format(name) is fmt
    assert fmt.max == float(fi.max) and fmt.min_normal == float(fi.smallest_normal)
    assert fmt.bits == fi.bits and fmt.exp_bits == fi.nexp and fmt.man_bits == fi.nmant
    # ml_dtypes reports E8M0's smallest subnormal as its smallest normal; we say 0.0 (it has none).
    assert fmt.min_subnormal == (0.0 if name == "e8m0" else float(fi.smallest_subnormal))
    assert fmt.grid()[-1].item() == fmt.max
    if fmt.torch_dtype is not None:
        tf = torch.finfo(fmt.torch_dtype)
        assert (tf.max, tf.smallest_normal, tf.bits) == (fmt.max, fmt.min_normal, fmt.bits)


def test_known_grids_and_names():
    assert FORMATS["e2m1"].grid().tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert FORMATS["e8m0"].grid().tolist() == [2.0**k for k in range(-127, 128)]
    assert list(FORMATS) == ["e4m3", "e5m2", "e2m1", "e3m2", "e2m3", "e8m0"]
    assert FORMATS["e4m3"].torch_dtype == torch.float8_e4m3fn and FORMATS["e5m2"].torch_dtype == torch.float8_e5m2
    assert FORMATS["e2m1"].torch_dtype is None
    with pytest.raises(LowbitError, match="e9m9.*e4m3, e5m2, e2m1, e3m2, e2m3, e8m0"):
        get_format("e9m9")
    assert get_format("E4M3") is FORMATS["e4m3"]


@pytest.mark.parametrize("name", NAMES)
def test_decode_every_code_matches_ml_dtypes(name):
    fmt = FORMATS[name]
    codes = np.arange(1 << fmt.bits, dtype=np.uint8)
    want = codes.view(ML[name]).astype(np.float32)
    got = fmt.decode(torch.from_numpy(codes)).numpy()
    assert_same_bits(got, want, codes)
    ok = ~np.isnan(want)
    back = fmt.encode(torch.from_numpy(got[ok])).numpy()
    np.testing.assert_array_equal(back, codes[ok])


def test_decode_and_encode_reject_bad_input():
    with pytest.raises(LowbitError, match="< 16"):
        FORMATS["e2m1"].decode(torch.tensor([0x21], dtype=torch.uint8))
    with pytest.raises(LowbitError, match="uint8"):
        FORMATS["e4m3"].decode(torch.tensor([1, 2]))
    with pytest.raises(LowbitError, match="NaN"):
        FORMATS["e2m1"].encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(LowbitError, match="float64"):
        FORMATS["e4m3"].quantize(torch.zeros(3, dtype=torch.float64))


# ---------------------------------------------------------------- rounding against the references


@pytest.mark.parametrize("name", NAMES)
def test_quantize_matches_ml_dtypes_bit_for_bit(name):
    fmt, x = FORMATS[name], mixture(name)
    clamped = np.clip(x, -fmt.max, fmt.max)  # keeps NaN
    # Formats without NaN: ml_dtypes turns NaN into a zero; quantize keeps it NaN (documented), so
    # NaN inputs are checked separately.
    keep = np.ones(len(x), bool) if fmt.has_nan else ~np.isnan(x)
    for got, want in [(q(name, x, saturate=False), ml_cast(x, name)), (q(name, x), ml_cast(clamped, name))]:
        assert_same_bits(got[keep], want[keep], x[keep])
        assert np.isnan(got[np.isnan(x)]).all()
    codes = fmt.encode(torch.from_numpy(x[keep])).numpy()
    stored = np.where(np.isinf(x), x, clamped) if fmt.has_inf else clamped  # encode keeps E5M2's Inf
    with np.errstate(all="ignore"):
        want_codes = stored[keep].astype(ML[name]).view(np.uint8)
    np.testing.assert_array_equal(codes, want_codes)


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_quantize_matches_torch_float8_casts(name):
    fmt, x = FORMATS[name], mixture(name)
    clamped = torch.from_numpy(np.clip(x, -fmt.max, fmt.max))
    assert_same_bits(q(name, x), clamped.to(fmt.torch_dtype).float().numpy(), x)
    # torch's e4m3fn cast saturates on some builds and not on others, so compare the unsaturated
    # semantics only where nothing overflows.
    inside = np.isnan(x) | (np.abs(x) <= fmt.max)
    want = torch.from_numpy(x[inside]).to(fmt.torch_dtype).float().numpy()
    assert_same_bits(q(name, x[inside], saturate=False), want, x[inside])


def test_overflow_thresholds_and_specials():
    e4m3, e5m2, e2m1, e8m0 = (FORMATS[n] for n in ("e4m3", "e5m2", "e2m1", "e8m0"))
    below = float(np.nextafter(np.float32(464), np.float32(0)))
    x = torch.tensor([below, 464.0, 464.00003, -1e30, float("inf"), float("nan")])
    nonsat = e4m3.quantize(x, saturate=False)
    assert nonsat[:2].tolist() == [448.0, 448.0] and torch.isnan(nonsat[2:]).all()  # 464 is a tie, kept by RNE
    assert e4m3.quantize(x).tolist()[:5] == [448.0, 448.0, 448.0, -448.0, 448.0]
    assert e5m2.quantize(torch.tensor([61439.996, 61440.0]), saturate=False).tolist() == [57344.0, math.inf]
    assert e2m1.quantize(torch.tensor([1e9, -math.inf]), saturate=False).tolist() == [6.0, -6.0]
    assert e8m0.quantize(torch.tensor([2.9, 3.0, 1.5, 1e-45])).tolist() == [2.0, 4.0, 2.0, 2.0**-127]
    assert torch.isnan(e8m0.quantize(torch.tensor([0.0, -0.0, -1.0, float("nan")]))).all()
    assert torch.isnan(e8m0.quantize(torch.tensor([math.inf, 1.5 * 2.0**127]), saturate=False)).all()
    assert e8m0.quantize(torch.tensor([math.inf, 1.5 * 2.0**127])).tolist() == [2.0**127] * 2
    assert torch.signbit(e4m3.quantize(torch.tensor([-1e-30]))).item()  # -tiny -> -0.0


def test_half_precision_inputs_are_upcast_exactly():
    x = torch.randn(4096) * 10
    for dt in (torch.bfloat16, torch.float16):
        got = FORMATS["e4m3"].quantize(x.to(dt))
        assert got.dtype == torch.float32 and torch.equal(got, FORMATS["e4m3"].quantize(x.to(dt).float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", NAMES)
def test_cuda_matches_cpu(name):
    fmt, x = FORMATS[name], torch.from_numpy(mixture(name))
    for sat in (True, False):
        assert_same_bits(fmt.quantize(x.cuda(), saturate=sat).cpu().numpy(), fmt.quantize(x, saturate=sat).numpy(),
                         x.numpy())
    ok = x if fmt.has_nan else x[~torch.isnan(x)]
    assert torch.equal(fmt.encode(ok.cuda()).cpu(), fmt.encode(ok))


# ---------------------------------------------------------------- properties


def values(name: str, positive: bool = False):
    fmt = FORMATS[name]
    lim = float(np.float32(min(4 * fmt.max, 3e38)))
    lo = 0.0 if (positive or not fmt.signed) else -lim
    return st.lists(st.floats(lo, lim, width=32, exclude_min=lo == 0.0), min_size=1, max_size=64).map(
        lambda v: np.array(v, np.float32))


def props(f):
    return settings(max_examples=60, deadline=None)(f)


@pytest.mark.parametrize("name", NAMES)
@props
@given(data=st.data())
def test_idempotent_bounded_on_grid(name, data):
    fmt = FORMATS[name]
    x = data.draw(values(name))
    y = q(name, x)
    assert_same_bits(q(name, y), y, x)
    assert (np.abs(y) <= fmt.max).all()
    g = fmt.grid().double().numpy()
    a = np.abs(y.astype(np.float64))
    assert (g[np.clip(np.searchsorted(g, a), 0, len(g) - 1)] == a).all()


@pytest.mark.parametrize("name", NAMES)
@props
@given(data=st.data())
def test_monotone(name, data):
    x = np.sort(data.draw(values(name)))
    assert (np.diff(q(name, x).astype(np.float64)) >= 0).all()


@pytest.mark.parametrize("name", NAMES)
@props
@given(data=st.data())
def test_error_at_most_half_a_quantum(name, data):
    fmt = FORMATS[name]
    x = data.draw(values(name)).astype(np.float64)
    if name == "e8m0":
        # Above 2^-126: quantum = the binade's own value. Below it ml_dtypes' fp32-subnormal rule applies.
        x = x[(x >= 2.0**-126) & (x <= fmt.max)]
        quantum = 2.0 ** (np.frexp(x)[1] - 1)
    else:
        x = x[np.abs(x) <= fmt.max]
        e = np.maximum(np.frexp(x)[1] - 1, 1 - fmt.bias)
        quantum = 2.0 ** (e - fmt.man_bits)
    err = np.abs(q(name, x).astype(np.float64) - x)
    assert (err <= quantum / 2).all()


@pytest.mark.parametrize("name", SIGNED)
@props
@given(data=st.data())
def test_odd_symmetry(name, data):
    x = data.draw(values(name))
    assert_same_bits(q(name, -x), -q(name, x), x)


@pytest.mark.parametrize("name", NAMES)
@props
@given(data=st.data(), seed=st.integers(0, 2**31))
def test_stochastic_lands_on_a_neighbour(name, data, seed):
    fmt = FORMATS[name]
    x = data.draw(values(name))
    y = q(name, x, stochastic=True, generator=torch.Generator().manual_seed(seed)).astype(np.float64)
    g = fmt.grid().double().numpy()
    a = np.abs(x.astype(np.float64))
    lo = g[np.clip(np.searchsorted(g, a, "right") - 1, 0, len(g) - 1)]
    hi = g[np.clip(np.searchsorted(g, a, "left"), 0, len(g) - 1)]
    assert ((np.abs(y) == lo) | (np.abs(y) == hi)).all()
    if fmt.signed:
        assert (np.signbit(y) == np.signbit(x)).all()


@pytest.mark.parametrize("name", NAMES)
def test_stochastic_is_unbiased_and_seeded(name):
    fmt = FORMATS[name]
    g = fmt.grid().double().numpy()
    rng = np.random.default_rng(1)
    # Points inside gaps across the range: the first gaps (subnormals or 2^-127), the middle, the top.
    gaps = np.unique(np.r_[0, 1, 2, len(g) // 2, len(g) - 3, len(g) - 2])
    x = (g[gaps] + rng.uniform(0.05, 0.95, len(gaps)) * (g[gaps + 1] - g[gaps])).astype(np.float32)
    if fmt.signed:
        x[::2] *= -1
    n = 20_000
    xs = torch.from_numpy(np.repeat(x, n))
    draws = fmt.quantize(xs, stochastic=True, generator=torch.Generator().manual_seed(0)).double().view(len(x), n)
    gap = torch.from_numpy(g[gaps + 1] - g[gaps])
    # Standard error of the mean is at most gap / (2 sqrt(n)); allow 6 of them.
    assert ((draws.mean(1) - torch.from_numpy(x).double()).abs() <= 6 * gap / (2 * math.sqrt(n))).all()
    again = fmt.quantize(xs, stochastic=True, generator=torch.Generator().manual_seed(0)).double().view(len(x), n)
    assert torch.equal(draws, again)


# ---------------------------------------------------------------- FP4 packing


def test_pack_fp4_nibble_order_and_round_trip():
    codes = torch.tensor([[0x1, 0x2, 0xF, 0x0], [0x7, 0x8, 0x3, 0xC]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xC3]]  # element 2i low nibble, 2i+1 high nibble
    assert torch.equal(unpack_fp4(packed), codes)
    every = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_fp4(unpack_fp4(every)), every)
    x = torch.randn(3, 5, 64) * 3
    codes = FORMATS["e2m1"].encode(x)
    assert torch.equal(FORMATS["e2m1"].decode(unpack_fp4(pack_fp4(codes))), FORMATS["e2m1"].quantize(x))


def test_pack_fp4_rejects_bad_input():
    with pytest.raises(LowbitError, match="even"):
        pack_fp4(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(LowbitError, match="< 16"):
        pack_fp4(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(LowbitError, match="uint8"):
        pack_fp4(torch.zeros(2, dtype=torch.int64))
    with pytest.raises(LowbitError, match="uint8"):
        unpack_fp4(torch.zeros(2, dtype=torch.float32))
