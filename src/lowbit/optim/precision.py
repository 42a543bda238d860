"""Where each optimizer state is stored (FP8-LM's precision decoupling) and how a tensor is stored there.

Every kind is held as `data` plus a per-tensor power-of-two `scale` (dequantized value = data / scale). Unscaled
kinds (fp32, bf16) keep scale 1. Scaled kinds put the tensor's amax at the top of the format's range, so a
second moment (gradient squared: twice the gradient's dynamic range in binades) keeps its small entries: fp16
then spans 2^-24..2^16 times the scale, E4M3 only 2^-9..2^8.5.

Rounding to nearest can freeze a state: a decay by beta moves a value by (1 - beta), and where that is under half
an ulp (E5M2: 2 mantissa bits, half an ulp >= 6.25% > 1 - 0.95) the product rounds back to the value itself, so
an E5M2 second moment never decays, it only grows. Stochastic rounding (rounding="stochastic") rounds up with
probability equal to the distance from the lower neighbour over the ulp: unbiased, so a state decays on average
as in fp32.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from lowbit.errors import LowbitError

# kind -> (storage dtype, scaled, largest finite value)
KINDS = {
    "fp32": (torch.float32, False, torch.finfo(torch.float32).max),
    "bf16": (torch.bfloat16, False, torch.finfo(torch.bfloat16).max),
    "fp16": (torch.float16, True, 65504.0),
    "e4m3": (torch.float8_e4m3fn, True, 448.0),
    "e5m2": (torch.float8_e5m2, True, 57344.0),
}
ALLOWED = {
    "weights": ("fp32", "bf16", "fp16"),  # fp16: scaled, its own master (lowbit.optim.scaled_weight)
    "master": ("none", "fp32", "bf16", "fp16"),
    "grads": ("fp32", "bf16", "e4m3", "e5m2"),
    "exp_avg": ("fp32", "bf16", "e4m3"),
    "exp_avg_sq": ("fp32", "bf16", "fp16", "e4m3", "e5m2"),
    "rounding": ("nearest", "stochastic"),
    "scales": ("amax", "bound", "mixed"),
}
STORED = ("weights", "master", "grads", "exp_avg", "exp_avg_sq")  # the fields that name a storage kind
# kind -> (smallest normal exponent, mantissa bits): the grid stochastic rounding rounds onto. bf16's exponent
# floor is -119, not -126: its smallest grid step stays a normal fp32 (2^-126), which GPU flush-to-zero math can't
# zero; below 2^-119 it rounds on a coarser grid than bf16's subnormals, still exactly representable and unbiased.
GRID = {"bf16": (-119, 7), "fp16": (-14, 10), "e4m3": (-6, 3), "e5m2": (-14, 2)}


@dataclass(frozen=True)
class StatePrecision:
    """Storage of one parameter and its optimizer states. Update math is always fp32.

    weights: the parameter the model computes with (fp16: a ScaledFP16Weight, seen as bf16, its own master).
    master: a separate copy the update is applied to (`none`: the weights are the master). grads: what a
    gradient is kept in between backward and the step. rounding: how the update writes the states it keeps
    (exp_avg, exp_avg_sq, master, and bf16 or fp16 weights that are their own master), nearest or stochastic;
    gradients, and weights written from a master, always round to nearest. scales: how a scaled state's new scale
    is chosen: from its new amax (`amax`, MS-AMP's two stages: two passes over memory), from a bound of it that
    the last step's amaxes and the gradient's scale give (`bound`: one pass; see state_bounds), or from the amax
    for the FP8 states and the bound for the FP16 ones (`mixed`: the amax pass computes only the FP8 states; under
    fp8lm-o2 it reads the gradient and first moment)."""

    weights: str = "fp32"
    master: str = "none"
    grads: str = "fp32"
    exp_avg: str = "fp32"
    exp_avg_sq: str = "fp32"
    rounding: str = "nearest"
    scales: str = "amax"

    def __post_init__(self):
        for key, allowed in ALLOWED.items():
            if getattr(self, key) not in allowed:
                raise LowbitError(f"optim.{key}: {getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.grads == "fp32" and self.weights != "fp32":
            raise LowbitError(f"optim.grads: fp32 gradients need fp32 weights (autograd delivers gradients in the "
                              f"weights' dtype, {self.weights})")
        if self.weights == "fp16" and self.master != "none":
            raise LowbitError(f"optim.master: fp16 weights keep a per-tensor scale and are their own master; use "
                              f"master = \"none\" (got {self.master})")
        if self.master == self.weights:
            raise LowbitError(f"optim.master: a {self.master} master copy of {self.weights} weights is the weights "
                              f"again; use master = \"none\"")

    @property
    def all_fp32(self) -> bool:
        return replace(self, rounding="nearest", scales="amax") == StatePrecision()  # fp32: nothing to round or scale

    def bytes_per_param(self) -> dict[str, float]:
        """The theoretical figure: bytes per parameter by category (per-tensor scales left out)."""
        size = {k: 0 if v == "none" else KINDS[v][0].itemsize for k, v in asdict(self).items() if k in STORED}
        return {**size, "total": sum(size.values())}


def fp32_default() -> StatePrecision:
    return StatePrecision()


def pow2_scale(amax: torch.Tensor, fmax: float, old: torch.Tensor) -> torch.Tensor:
    """The largest power of two s with amax * s <= fmax; the old scale when amax is 0, NaN or Inf (1 if the old
    one is not a usable scale either)."""
    a = amax.float()
    old = torch.where(torch.isfinite(old) & (old > 0), old, torch.ones_like(old))
    good = torch.isfinite(a) & (a > 0)
    safe = torch.where(good, a, torch.ones_like(a))
    s = torch.exp2(torch.floor(torch.log2(fmax / safe)).clamp(-126, 126))
    s = torch.where(safe * s > fmax, s * 0.5, s)  # log2 rounding at exact powers of two
    return torch.where(good, s, old)


_M32 = 0xFFFFFFFF


def uniform_like(a: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) numbers shaped like `a`, from the global generator. On a GPU, and eagerly, torch.rand_like
    (on a GPU Philox, which inductor inlines). Compiled on the CPU, torch's generator costs 4-6 ns an element
    (200-290 ms for a 4096x11008 weight, most of nanotron-r2's 638 ms update there), so one 32-bit draw seeds a
    hash of each element's index instead (Wellons' lowbias32, multipliers under 2^31 so no int64 product
    overflows): integer arithmetic that compiles into the update's loop; 24 bits of each hash make the number
    (bias < 2^-24). Run eagerly those are a dozen int64 ops, 8x rand_like's time on a 256K slice: not there."""
    if a.device.type != "cpu" or not torch.compiler.is_compiling():
        return torch.rand_like(a, dtype=torch.float32)
    seed = torch.randint(0, 2**32, (), dtype=torch.int64)
    x = ((torch.arange(a.numel(), dtype=torch.int64).view(a.shape) & _M32) * 0x61C88647 + seed) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _M32
    x = x ^ (x >> 15)
    return (x >> 8).float() * 2.0**-24


def stochastic_round(y: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 `y` rounded to one of its two neighbours in `kind`, up with probability (y - lower) / ulp, so the
    expectation is y. Elementwise tensor math only (`uniform_like`, no host syncs): it compiles into the update."""
    emin, mbits = GRID[kind]
    a = y.abs()
    e = torch.floor(torch.log2(a))
    # log2 may land on the wrong side of a power of two (approximate GPU math): make 2^e <= a < 2^(e+1) exact
    e = e - (torch.exp2(e) > a).float() + (torch.exp2(e + 1) <= a).float()
    ulp = torch.exp2(e.clamp(min=emin) - mbits)  # zero and subnormals: the fixed ulp of the lowest binade
    steps = a / ulp  # exact: ulp is a power of two
    low = torch.floor(steps)
    # up with probability frac; comparing (not adding) keeps an fp32 sum's rounding from moving a grid value
    q = torch.copysign((low + (uniform_like(a) < steps - low).float()) * ulp, y)
    return torch.where(torch.isfinite(y), q, y)  # Inf and NaN as round-to-nearest leaves them


def encode(x: torch.Tensor, kind: str, scale: torch.Tensor, out: torch.Tensor | None = None,
           amax: torch.Tensor | None = None, rounding: str = "nearest") -> torch.Tensor:
    """Store `x` as `kind` (into `out` if given); updates the per-tensor `scale` in place for scaled kinds (from
    `amax` if the caller has it). `rounding`: nearest, or stochastic (kinds below fp32). Returns the stored data."""
    if KINDS[kind][1]:
        scale.copy_(pow2_scale(x.abs().amax() if amax is None else amax, KINDS[kind][2], scale))
    return store(x, kind, scale, out, rounding)


def store(x: torch.Tensor, kind: str, scale: torch.Tensor, out: torch.Tensor | None = None,
          rounding: str = "nearest") -> torch.Tensor:
    """`x` stored as `kind` with a given `scale` (ignored by unscaled kinds); elementwise, so a slice of `x`
    stored into the same slice of `out` gives the bytes the whole tensor would."""
    dtype, scaled, fmax = KINDS[kind]
    sr = rounding == "stochastic" and kind in GRID
    if scaled:
        y = x * scale
        data = (stochastic_round(y.float(), kind) if sr else y).clamp_(-fmax, fmax).to(dtype)
    else:
        data = (stochastic_round(x.float(), kind) if sr else x).to(dtype)
    if out is None:
        return data
    out.copy_(data)
    return out


def _fp8_bits_to_float(data: torch.Tensor) -> torch.Tensor:
    """FP8 bytes to fp32 by integer ops, for the CPU: torch converts FP8 there one element at a time (~2 ns per
    element, 10x a vectorized op). An E5M2 byte is the top byte of an fp16; an E4M3 byte shifted into an fp16's
    exponent and mantissa fields is its value times 2^-8 (subnormals included); its NaN, 0x7f, gets the fp16
    exponent 31 added ((mag + 1) >> 7 is 1 there alone)."""
    b = data.view(torch.uint8).to(torch.int16)
    if data.dtype == torch.float8_e5m2:
        return (b << 8).view(torch.float16).float()
    mag = b & 0x7F
    bits = ((b & 0x80) << 8) | ((mag << 7) + (((mag + 1) >> 7) << 14))
    return bits.view(torch.float16).float() * 256.0


# Compiled, the CPU decodes FP8 by torch's cast, which inductor vectorizes with AVX-512 and converts element by
# element without it. Two replacements lost on an AVX2 build of the update (ATEN_CPU_CAPABILITY=avx2, a 4096x11008
# fp8lm-o2 update): a 256-entry table, 484-513 ms against the cast's 264-304 (its gather keeps the loop scalar), and
# an integer-field decode bit-cast from int32, which torch 2.13's inductor compiled into NaN states
# (tests/test_optim.py runs the compiled update under that setting).


def decode(data: torch.Tensor, kind: str, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of stored data. Scales are powers of two (`pow2_scale`, 2^-126 to 2^126), so times the
    reciprocal is the division, bit for bit: an elementwise division costs a CPU's vector unit 10-20x a product
    (in the compiled fp8lm-o2 update, four of each pass's six divisions)."""
    fp8 = data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    compiled = torch.compiler.is_compiling()
    if fp8 and data.device.type == "cpu" and not compiled:
        x = _fp8_bits_to_float(data)
    else:
        x = data.float()
    return x * scale.reciprocal() if KINDS[kind][1] else x
