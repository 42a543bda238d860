"""What the model keeps for backward outside its linears, stored compressed (COAT, Xi et al. 2024): SwiGLU's two
inputs and the norms' inputs as E4M3 with one scale per row (token). A recipe turns it on
(`Recipe.saved_activations`); the model's SwiGLU and RMSNorm take any codec (pack / unpack) and know no format.

Forward is unchanged; backward computes with the dequantized inputs, so gradients are approximate (docs/numerics.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling


@dataclass(frozen=True)
class RowScaledCodec:
    """A tensor as 1-byte elements (or whatever `spec` holds) plus an fp32 scale per row of its last dimension."""

    spec: Scaling

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(t.device.type, enabled=False):
            q = quantize(t.detach().reshape(-1, t.shape[-1]), self.spec)
        return q.data.view(t.shape), q.scale_inv.view(*t.shape[:-1], 1)

    @staticmethod
    def unpack(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (data.float() * scale_inv).to(dtype)


def compress_saved_activations(model: nn.Module, spec: Scaling, skip=lambda name: False) -> list[str]:
    """Give every module that takes a codec (SwiGLU, the norms) one for `spec`; `skip(name)` leaves a module
    exact. Returns the names of those that got one."""
    if spec.granularity != "row":
        raise ValueError(f"saved activations are scaled per row, not per {spec.granularity}")
    codec, names = RowScaledCodec(spec), []
    for name, m in model.named_modules():
        if hasattr(m, "codec") and not skip(name):
            m.codec = codec
            names.append(name)
    return names
