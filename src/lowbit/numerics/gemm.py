"""scaled_matmul: the one place a low-precision GEMM is computed.

`torch._scaled_mm` where the device has the combination (tensorwise and rowwise FP8 on sm89+ GPUs; on CPU the same
math through the fp32 GEMM, since torch's CPU kernel is a slow reference), exact emulation everywhere else:
dequantize each operand (data * scale_inv) and multiply in fp32. With power-of-two scales (MX, `pow2=True`) the
dequantized operands are exact and so is the emulation up to fp32 accumulation order.
"""

from __future__ import annotations

import functools
import warnings

import torch

from lowbit.numerics.qtensor import QTensor

_warned: set = set()


def _warn_once(key, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"lowbit: {msg}", stacklevel=3)


def fast_path_reason(a: QTensor, b: QTensor, out_dtype: torch.dtype) -> str | None:
    """None if the scaled path takes a @ bᵀ here (torch._scaled_mm on a GPU; its math through the fp32 GEMM on
    CPU, for the combinations torch's CPU kernel accepts), else why not (for the one-time message)."""
    if a.data.dtype not in _FP8 or b.data.dtype not in _FP8:
        return "a format without a torch dtype"
    ga, gb = a.spec.granularity, b.spec.granularity
    if not {ga, gb} <= {"tensor", "row"}:
        return f"{ga} x {gb} scaling"
    K, N = a.shape[1], b.shape[0]
    if K % 16 or N % 16:
        return f"K={K}, N={N} not multiples of 16 (emulated rather than padded)"
    dev = a.data.device
    if dev.type == "cuda":
        if torch.cuda.get_device_capability(dev) < (8, 9):
            return "a GPU without FP8 tensor cores"
        if a.data.dtype == b.data.dtype == torch.float8_e5m2:
            return "E5M2 x E5M2 (no such kernel)"
        if "row" in (ga, gb) and (a.data.dtype != torch.float8_e4m3fn or b.data.dtype != torch.float8_e4m3fn):
            return "rowwise needs E4M3 x E4M3"
    elif dev.type != "cpu":
        return f"device {dev.type}"
    elif "row" in (ga, gb) and not _cpu_rowwise_supported():
        return "this torch's CPU _scaled_mm is tensorwise only"
    return None


@functools.cache
def _cpu_rowwise_supported() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes rowwise scales (2.13 does; 2.11 asserts): asked once."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
        return True
    except RuntimeError:
        return False


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _rowwise(q: QTensor, rows: int) -> torch.Tensor:
    s = q.scale_inv.float()
    return s.reshape(1, 1).expand(rows, 1).contiguous() if q.spec.granularity == "tensor" else s.reshape(rows, 1)


def scaled_matmul(a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32,
                  fast_accum: bool = False) -> torch.Tensor:
    """a [M, K] @ b [N, K]ᵀ -> [M, N] in `out_dtype`, fp32 accumulation. `fast_accum` lets Hopper's FP8 tensor
    cores skip the periodic promotion of partial sums (faster, less accurate; ignored by the emulation)."""
    reason = fast_path_reason(a, b, out_dtype)
    if reason is None:
        if a.spec.granularity == b.spec.granularity == "tensor":
            sa, sb = a.scale_inv.float().reshape(()), b.scale_inv.float().reshape(())
        else:
            sa, sb = _rowwise(a, a.shape[0]), _rowwise(b, b.shape[0]).reshape(1, -1)
        if not a.data.is_cuda:
            # torch's CPU _scaled_mm is a reference loop, ~1000x slower than an fp32 GEMM. Its math through the fp32
            # GEMM instead: FP8 x FP8 products are exact in fp32, sums in fp32, the scales applied to the result.
            with torch.autocast("cpu", enabled=False):
                return ((a.data.float() @ b.data.float().t()) * sa * sb).to(out_dtype)
        if a.spec.granularity != "tensor" or b.spec.granularity != "tensor":
            if out_dtype != torch.bfloat16:
                # CUDA's rowwise kernel writes bf16 only (fp32 accumulation inside): as torchao, round the result
                # to bf16, then convert (an fp32 dW or dx of an fp32 input keeps bf16's 8 bits of mantissa).
                return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast_accum).to(out_dtype)
        return torch._scaled_mm(a.data, b.data.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype,
                                use_fast_accum=fast_accum)
    if a.data.device.type == "cuda" or "multiples of 16" in reason:  # on CPU, emulation is expected otherwise
        _warn_once((a.shape, b.shape, reason), f"scaled GEMM {tuple(a.shape)} x {tuple(b.shape)}ᵀ emulated: {reason}")
    with torch.autocast(a.data.device.type, enabled=False):
        return (a.dequantize() @ b.dequantize().t()).to(out_dtype)
