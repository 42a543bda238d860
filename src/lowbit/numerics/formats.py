"""Exact low-precision float formats (FP8, FP6, FP4, E8M0) emulated with fp32 torch ops.

Every format here is a grid of values. ``quantize`` maps fp32 values onto that grid and returns
fp32 (so it runs on any device and any torch build, whether or not torch has the dtype);
``encode``/``decode`` convert between values and the format's bit patterns (uint8 codes).
Rounding is bit-exact with ml_dtypes' casts; see ``FloatFormat.quantize`` for the corner cases.

The work is done on the int32 view of fp32: the exponent field gives the binade without log2
rounding error, and every scaling is by a power of two built from bits, so nothing is inexact
except the one rounding we ask for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowbit.errors import LowbitError

__all__ = ["FloatFormat", "FORMATS", "get_format", "pack_fp4", "unpack_fp4"]

_MAN_MASK = 0x7FFFFF  # fp32 mantissa field
_MAN_HALF = 0x400000  # top bit of the fp32 mantissa field: set from 1.5 * 2^e up
_NAN_BITS = 0x7FC00000
_INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # upcast to fp32 exactly


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for an int32 tensor k in [-126, 127], built from bits (exact on every device)."""
    return ((k + 127) << 23).view(torch.float32)


def _as_fp32(x, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise LowbitError(f"{what} expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        # float64 would need a second rounding to reach fp32, so we refuse it rather than double-round.
        raise LowbitError(f"{what} expects a float32/float16/bfloat16 tensor, got {x.dtype}")
    # Rounding has no useful gradient; callers that train through it add a straight-through estimator.
    return x.detach().float()


@dataclass(frozen=True)
class FloatFormat:
    """A low-precision float format: sign (optional), ``exp_bits`` exponent bits, ``man_bits`` mantissa bits.

    Values are ``2^(E - bias) * (1 + M / 2^man_bits)`` for exponent field E > 0 and
    ``2^(1 - bias) * M / 2^man_bits`` (subnormals) for E == 0, except E8M0, which is ``2^(E - 127)``.
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max: float  # largest finite value
    min_normal: float
    min_subnormal: float  # 0.0 where the format has no subnormals (e8m0)
    has_inf: bool
    has_nan: bool
    signed: bool = True
    torch_dtype: torch.dtype | None = None  # torch's own dtype for this format, where this torch has one

    @property
    def bits(self) -> int:
        return int(self.signed) + self.exp_bits + self.man_bits

    @property
    def _emin(self) -> int:  # exponent of the smallest normal binade (also the subnormals' quantum binade)
        return 1 - self.bias

    @property
    def _emax(self) -> int:  # exponent of the binade holding max
        return math.frexp(self.max)[1] - 1

    @property
    def _nan_code(self) -> int:
        # The codes ml_dtypes produces: e4m3 S.1111.111, e5m2 quiet NaN S.11111.10, e8m0 0xFF.
        return {"e4m3": 0x7F, "e5m2": 0x7E, "e8m0": 0xFF}[self.name]

    # ------------------------------------------------------------------ values

    def quantize(self, x: torch.Tensor, *, saturate: bool = True, stochastic: bool = False,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Round ``x`` onto this format's grid; returns fp32 values (detached) of the same shape and device.

        Round to nearest, ties to even (ties-up in E8M0, see below), with gradual underflow; the sign
        of zero is kept (-tiny -> -0.0). NaN stays NaN in every format, including E2M1/E2M3/E3M2,
        which cannot encode it: quantize is a simulation and hiding a NaN would hide a bug.

        ``saturate=True``: overflows and +-Inf clamp to +-max. ``saturate=False`` follows the
        non-saturating ml_dtypes casts: a value overflows when it *rounds* above max (e4m3: |x| > 464,
        e5m2: |x| >= 61440) and becomes +-Inf (e5m2) or NaN (e4m3); formats with neither Inf nor NaN
        (E2M1, FP6) always saturate.

        ``stochastic=True``: round to one of the two neighbouring grid values with probability
        proportional to proximity, so E[q(x)] = x inside the range; draws come from ``torch.rand``
        with ``generator`` on x's device.

        E8M0 (unsigned powers of two, no zero): ``x`` in [2^k, 1.5*2^k) -> 2^k and [1.5*2^k, 2^(k+1))
        -> 2^(k+1) (nearest in the linear domain, ties up), as ml_dtypes (>= 0.7) and torch cast, for
        every k down to -127; positive values below 2^-127 give 2^-127. (torch's cast, like ml_dtypes
        before 0.7, sends all of (2^-127, 2^-126) up to 2^-126.) Zero, negatives and NaN give NaN in both
        modes: there is no zero or sign to land on, and a non-positive scale is a bug worth seeing.
        """
        x = _as_fp32(x, f"{self.name}.quantize")
        if self.name == "e8m0":
            return self._e8m0_codes_to_values(*self._e8m0_round(x, saturate, stochastic, generator))
        a = x.abs()
        # Binade exponent of |x|, clamped so subnormals share the smallest quantum and anything
        # above the top binade rounds to a multiple of the top quantum (> max, so it overflows).
        e = ((a.view(torch.int32) >> 23) - 127).clamp_(self._emin, self._emax)
        y = a * _pow2(self.man_bits - e)  # |x| / quantum, exact: scaling by a power of two
        if stochastic:
            lo = y.floor()
            u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            y = lo.add_((u < y - lo).float())  # frac = y - lo is exact, so P(up) = frac to 2^-24
        else:
            y = y.round()  # torch.round is round-half-to-even
        q = y.mul_(_pow2(e - self.man_bits))  # times quantum: exact again
        if saturate or not (self.has_inf or self.has_nan):
            q = q.clamp_(max=self.max)  # clamp propagates NaN
        else:
            q = q.masked_fill_(q > self.max, math.inf if self.has_inf else math.nan)
        return q.copysign_(x)

    def _e8m0_round(self, x, saturate, stochastic, generator):
        """E8M0 codes (int32, may exceed 254 on overflow) and a mask of inputs that map to NaN."""
        b = x.view(torch.int32)
        invalid = (b <= 0) | torch.isnan(x)  # sign bit set (incl. -0.0), +0.0, or NaN
        expo = b >> 23  # the fp32 exponent field is the E8M0 code of 2^floor(log2 x)
        man = b & _MAN_MASK
        sub = expo == 0  # fp32 subnormals: lower neighbour 2^-127 (code 0), upper 2^-126
        if stochastic:
            frac = torch.where(sub, (man - _MAN_HALF).clamp_(min=0).float() * 2.0**-22, man.float() * 2.0**-23)
            u = torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            code = expo + (u < frac).int()
        else:
            # Round up from mantissa 1.5 (ties up). An fp32 subnormal is man * 2^-149: 2^-127 is man 2^22
            # (_MAN_HALF), so the binade (2^-127, 2^-126) rounds up from 1.5 * 2^22.
            code = expo + (man >= _MAN_HALF + sub.int() * (_MAN_HALF // 2)).int()
        if saturate:
            code = code.clamp_(max=254)
        return code, invalid

    @staticmethod
    def _e8m0_codes_to_values(code: torch.Tensor, invalid: torch.Tensor) -> torch.Tensor:
        # A code c >= 1 is exactly the fp32 exponent field of 2^(c-127); code 0 (2^-127) is fp32 subnormal.
        bits = torch.where(code == 0, torch.full_like(code, _MAN_HALF), code << 23)
        bits = bits.masked_fill_(invalid | (code >= 255), _NAN_BITS)
        return bits.view(torch.float32)

    # ------------------------------------------------------------------ codes

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Bit patterns (uint8, low ``bits`` bits used) of ``x`` rounded with RNE and saturation.

        Finite overflows saturate to +-max; +-Inf is stored as +-Inf in E5M2, which has it (so
        encode(decode(c)) == c for every non-NaN code), and saturates elsewhere. NaN encodes as this
        format's NaN code (sign kept where there is one); in formats without NaN (E2M1, E2M3, E3M2) a
        NaN raises LowbitError rather than being stored as a number.
        """
        x = _as_fp32(x, f"{self.name}.encode")
        if self.name == "e8m0":
            code, invalid = self._e8m0_round(x, True, False, None)
            return code.masked_fill_(invalid, 0xFF).to(torch.uint8)
        if not self.has_nan and bool(torch.isnan(x).any()):
            raise LowbitError(f"cannot encode NaN in {self.name}, which has no NaN code")
        q = self.quantize(x)
        b = q.abs().view(torch.int32)
        normal = ((b >> 23) - 127 + self.bias) << self.man_bits | (b & _MAN_MASK) >> (23 - self.man_bits)
        # Subnormals (and zero): the code is the value counted in units of min_subnormal.
        subnormal = (q.abs() * (1.0 / self.min_subnormal)).int()
        code = torch.where(q.abs() >= self.min_normal, normal, subnormal)
        if self.has_inf:
            code = code.masked_fill_(torch.isinf(x), ((1 << self.exp_bits) - 1) << self.man_bits)
        if self.has_nan:
            code = code.masked_fill_(torch.isnan(q), self._nan_code)
        code = code | (torch.signbit(q).int() << (self.bits - 1))
        return code.to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 values of uint8 bit patterns; codes wider than the format raise LowbitError."""
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            got = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
            raise LowbitError(f"{self.name}.decode expects a uint8 tensor of codes, got {got}")
        c = codes.int()
        if self.name == "e8m0":
            return self._e8m0_codes_to_values(c, torch.zeros_like(c, dtype=torch.bool))
        if self.bits < 8 and bool((c >> self.bits).any()):
            raise LowbitError(f"{self.name} codes must be < {1 << self.bits} (packed FP4? use unpack_fp4 first)")
        m = self.man_bits
        e_field = (c >> m) & ((1 << self.exp_bits) - 1)
        man = c & ((1 << m) - 1)
        # Normal: (2^m + M) * 2^(E - bias - m); subnormal: M * 2^(1 - bias - m). Both exact in fp32.
        sig = torch.where(e_field > 0, man + (1 << m), man).float()
        v = sig * _pow2(e_field.clamp(min=1) - self.bias - m)
        top = e_field == (1 << self.exp_bits) - 1
        if self.has_inf:  # IEEE-like: top exponent is Inf (M == 0) or NaN
            v = torch.where(top, torch.where(man == 0, math.inf, math.nan), v)
        elif self.has_nan:  # e4m3fn: only the all-ones pattern is NaN
            v = v.masked_fill_(top & (man == (1 << m) - 1), math.nan)
        return torch.where((c >> (self.bits - 1)) & 1 == 1, -v, v)

    def grid(self) -> torch.Tensor:
        """All finite non-negative representable values, ascending, fp32 (CPU)."""
        n_pos = 1 << (self.bits - 1) if self.signed else 1 << self.bits
        v = self.decode(torch.arange(n_pos, dtype=torch.uint8))
        return v[torch.isfinite(v)].sort().values


def _fmt(name, exp_bits, man_bits, max, has_inf, has_nan, dtype_name=None):
    bias = (1 << (exp_bits - 1)) - 1
    return FloatFormat(name=name, exp_bits=exp_bits, man_bits=man_bits, bias=bias, max=float(max),
                       min_normal=2.0 ** (1 - bias), min_subnormal=2.0 ** (1 - bias - man_bits),
                       has_inf=has_inf, has_nan=has_nan,
                       torch_dtype=getattr(torch, dtype_name, None) if dtype_name else None)


# Constants from the OCP FP8 and MX v1.0 specs (checked against ml_dtypes.finfo in the tests).
FORMATS: dict[str, FloatFormat] = {
    "e4m3": _fmt("e4m3", 4, 3, 448, has_inf=False, has_nan=True, dtype_name="float8_e4m3fn"),
    "e5m2": _fmt("e5m2", 5, 2, 57344, has_inf=True, has_nan=True, dtype_name="float8_e5m2"),
    "e2m1": _fmt("e2m1", 2, 1, 6, has_inf=False, has_nan=False),
    "e3m2": _fmt("e3m2", 3, 2, 28, has_inf=False, has_nan=False),
    "e2m3": _fmt("e2m3", 2, 3, 7.5, has_inf=False, has_nan=False),
    "e8m0": FloatFormat(name="e8m0", exp_bits=8, man_bits=0, bias=127, max=2.0**127, min_normal=2.0**-127,
                        min_subnormal=0.0, has_inf=False, has_nan=True, signed=False,
                        torch_dtype=getattr(torch, "float8_e8m0fnu", None)),
}


def get_format(name: str | FloatFormat) -> FloatFormat:
    """The format called ``name`` (case-insensitive); a FloatFormat is returned as is."""
    if isinstance(name, FloatFormat):
        return name
    fmt = FORMATS.get(str(name).strip().lower())
    if fmt is None:
        raise LowbitError(f"unknown float format {name!r}; known formats: {', '.join(FORMATS)}")
    return fmt


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes [..., 2k] into bytes [..., k]: element 2i in the low nibble, 2i+1 in the high one.

    This is the OCP / torch.float4_e2m1fn_x2 byte layout, so the result can be viewed as that dtype.
    """
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise LowbitError("pack_fp4 expects a uint8 tensor of E2M1 codes")
    if codes.dim() == 0 or codes.shape[-1] % 2:
        raise LowbitError(f"pack_fp4 needs an even last dimension, got shape {tuple(codes.shape)}")
    if bool((codes >> 4).any()):
        raise LowbitError("pack_fp4 codes must be < 16 (encode values with FORMATS['e2m1'].encode first)")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: uint8 bytes [..., k] -> E2M1 codes [..., 2k]."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise LowbitError("unpack_fp4 expects a uint8 tensor of packed E2M1 bytes")
    if packed.dim() == 0:
        raise LowbitError("unpack_fp4 needs at least one dimension")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
