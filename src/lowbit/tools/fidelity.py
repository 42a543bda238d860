"""How close a recipe's linear layer is to the high-precision one: cosine similarity of the output (fprop) and of
both gradients (dgrad, wgrad) on LLaMA-shaped random inputs. Used by the tests and benchmarks/numerics_fidelity.py."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.numerics.linear import LowPrecisionLinear
from lowbit.numerics.recipes import get_recipe


def llama_like_inputs(tokens: int, dim: int, hidden: int, seed: int = 0):
    """x: RMS-normalized activations with a few outlier channels (as LLMs have); W: N(0, 0.02); dy: small."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=g)
    outliers = torch.randperm(dim, generator=g)[: max(1, dim // 256)]
    x[:, outliers] *= 20.0
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    w = torch.randn(hidden, dim, generator=g) * 0.02
    dy = torch.randn(tokens, hidden, generator=g) * 1e-4
    return x, w, dy


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _run(layer: nn.Module, x, dy, dtype=torch.float32):
    xx = x.to(dtype).requires_grad_()
    y = layer(xx)
    y.backward(dy.to(y.dtype))
    return y.float(), xx.grad.float(), layer.weight.grad.float()


def linear_fidelity(recipe: str, tokens: int = 512, dim: int = 1024, hidden: int = 2816, seed: int = 0) -> dict:
    """{"fprop", "dgrad", "wgrad"}: cosine similarity to the fp64 reference (after one warm-up step)."""
    x, w, dy = llama_like_inputs(tokens, dim, hidden, seed)
    ref = (x.double() @ w.double().t(), dy.double() @ w.double(), dy.double().t() @ x.double())
    if recipe == "bf16":
        layer = nn.Linear(dim, hidden, bias=False, dtype=torch.bfloat16)
        layer.weight.data.copy_(w)
        out = _run(layer, x, dy, torch.bfloat16)
    else:
        base = nn.Linear(dim, hidden, bias=False)
        base.weight.data.copy_(w)
        layer = LowPrecisionLinear.from_linear(base, get_recipe(recipe).linear)
        _run(layer, x, dy)  # one step first, so delayed scaling has a history (its steady state is measured)
        layer.weight.grad = None
        out = _run(layer, x, dy)
    return {k: _cos(o, r) for k, o, r in zip(("fprop", "dgrad", "wgrad"), out, ref)}
