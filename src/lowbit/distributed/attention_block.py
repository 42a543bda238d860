"""One block of blockwise attention through a fused kernel that also gives the log-sum-exp of its score rows.

Ring attention and RSA (context_parallel.py) compute attention as a sum over (query block, key block) pairs. Each
pair goes through torch's own flash kernels at the aten level, the only level that returns the log-sum-exp
(`F.scaled_dot_product_attention` drops it) and whose backward accepts a given output and log-sum-exp, so the
ring's backward can hand every block the GLOBAL output and log-sum-exp:

    CUDA, bf16/fp16, head_dim a multiple of 8 up to 256   aten._scaled_dot_product_flash_attention(_backward)
    CPU                                                   aten._scaled_dot_product_flash_attention_for_cpu(_backward)
    anything else (CUDA fp32, an op missing)              `math_forward` / `math_backward` below

The math path is written out here because no library op returns the log-sum-exp for every dtype and device; it
builds one transient Lq×Lk fp32 block (never saved) and is the reference the kernels are tested against.

`causal` is only ever asked of square blocks whose queries and keys hold the same positions (the diagonal), where
top-left and bottom-right alignment agree. Shapes: q [B, H, Lq, D], k and v [B, H, Lk, D]; lse [B, H, Lq] fp32.
"""

from __future__ import annotations

import torch

_OPS = torch.ops.aten
FORCE_MATH = {"on": False}  # tests compare the kernels with the math path


def kernel(q: torch.Tensor) -> str:
    """Which implementation a block of these queries runs: flash-cuda, flash-cpu or math."""
    if FORCE_MATH["on"]:
        return "math"
    d = q.shape[-1]
    if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and d % 8 == 0 and d <= 256 \
            and hasattr(_OPS, "_scaled_dot_product_flash_attention_backward"):
        return "flash-cuda"
    if q.device.type == "cpu" and hasattr(_OPS, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return "flash-cpu"
    return "math"


def block_forward(q, k, v, causal: bool, scale: float):
    """(out in q's dtype, lse fp32 [B, H, Lq]) of softmax(q kᵀ · scale) v, causal on a diagonal block."""
    which = kernel(q)
    if which == "flash-cuda":
        out, lse = _OPS._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    if which == "flash-cpu":
        return _OPS._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return math_forward(q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block given the output and log-sum-exp of the WHOLE attention row: the block's
    probabilities are exp(s − lse) and the softmax correction is rowsum(dout · out), both global quantities."""
    which = kernel(q)
    if which == "flash-cuda":
        lq, lk = q.shape[-2], k.shape[-2]
        cum, seed, offset = _no_dropout_args(q)
        return _OPS._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.contiguous(), cum, cum, lq, lk, 0.0, causal, seed, offset, scale=scale)
    if which == "flash-cpu":
        return _OPS._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse.contiguous(), 0.0, causal, scale=scale)
    return math_backward(dout, q, k, v, out, lse, causal, scale)


_PLACEHOLDERS: dict = {}


def _no_dropout_args(q):
    """The (cumulative lengths, rng seed, rng offset) a forward without dropout returns, which its backward takes
    back unread: taken from one tiny forward per device and dtype, so their dtypes are whatever this torch uses."""
    key = (q.device, q.dtype)
    if key not in _PLACEHOLDERS:
        t = torch.zeros(1, 1, 8, q.shape[-1], dtype=q.dtype, device=q.device)
        res = _OPS._scaled_dot_product_flash_attention(t, t, t, 0.0, False, False)
        _PLACEHOLDERS[key] = (res[2], res[6], res[7])
    return _PLACEHOLDERS[key]


def _scores(q, k, causal: bool, scale: float):
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def math_forward(q, k, v, causal: bool, scale: float):
    """The reference: fp32 scores, outside autocast (which would run the products in bf16)."""
    with torch.autocast(q.device.type, enabled=False):
        s = _scores(q, k, causal, scale)
        lse = torch.logsumexp(s, -1)
        out = torch.exp(s - lse[..., None]) @ v.float()
    return out.to(q.dtype), lse


def math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    with torch.autocast(q.device.type, enabled=False):
        do = dout.float()
        p = torch.exp(_scores(q, k, causal, scale) - lse[..., None].float())
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ v.float().transpose(-1, -2) - (do * out.float()).sum(-1, keepdim=True))
        dq, dk = (ds @ k.float()) * scale, (ds.transpose(-1, -2) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
