"""How K/V blocks travel around the context-parallel ring (parallel.cp_kv_dtype).

    auto  as they are, in the activation dtype: attention over the ranks is exact.
    fp8   E4M3 bytes with one power-of-two scale per (sequence, head) of the shard: FP8 attention's cast
          (numerics.attention.quantize_heads), about half the bytes of bf16.

Under fp8 every block a rank computes with, its own included, is the dequantized one: each rank's attention is
then exactly attention over the quantized K/V, whichever rank holds a position (the local block costs the same
cast it needs for sending anyway). A power-of-two scale makes the dequantization exact. The gradient passes the
cast straight through (dK/dV of the dequantized values are those of K/V), and dK/dV travel in fp32 as before.
"""

from __future__ import annotations

import torch

from lowbit.errors import LowbitError
from lowbit.numerics.attention import dequantize_heads, quantize_heads

KV_DTYPES = ("auto", "fp8")


class KVWire:
    """`pack` a K or V block [B, H, L, D] into the tensors that travel; `unpack` them into the block the kernel
    reads (in the dtype and shape of a local block, `like`)."""

    def __init__(self, kv_dtype: str = "auto"):
        if kv_dtype not in KV_DTYPES:
            raise LowbitError(f"parallel.cp_kv_dtype: {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
        self.fp8 = kv_dtype == "fp8"

    def pack(self, t: torch.Tensor) -> list[torch.Tensor]:
        if not self.fp8:
            return [t]
        data, scale_inv = quantize_heads(t)
        # bytes on the wire: a float8 dtype is not every backend's (gloo's) to send
        return [data.view(torch.uint8), scale_inv]

    def unpack(self, wire: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
        if not self.fp8:
            return wire[0]
        data, scale_inv = wire
        return dequantize_heads(data.view(torch.float8_e4m3fn), scale_inv, like.dtype)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """The block this rank computes with for its own K/V: what the others receive."""
        return self.unpack(self.pack(t), t) if self.fp8 else t
