"""Where eager FP8 gradients turn non-finite on a GPU: a small LLaMA's fwd+bwd, every GEMM's FP8 operands and every
dgrad output checked.

    python benchmarks/eager_fp8_grads.py [--recipes fp8-tensorwise,fp8-delayed] [--fused-transpose]
        > eager_fp8_grads_{dev}_log.txt

For each recipe, eager with dgrad written as the recipe does and forced to bf16, then compiled: the parameters
whose gradients hold NaN/Inf; for each GEMM (fprop x·Wᵀ, dgrad dy·W, wgrad dyᵀ·x) whose FP8 operands hold
non-finite bytes, their counts; and for each dgrad, its output written as bf16, as fp32 and into a buffer filled
with NaN beforehand (elements the GEMM leaves unwritten stay NaN there). `--fused-transpose` turns
kernels.FUSED_TRANSPOSE on (the one-pass cast + transpose whose transposed copies of fp32 tensors held NaN bytes
on an H100). A diagnostic, not a test: tests/test_gpu.py holds the checks.
"""

from __future__ import annotations

import argparse

import torch

import lowbit.numerics.linear as linear
from lowbit.models.llama import Llama, ModelArgs
from lowbit.numerics import kernels
from lowbit.numerics.recipes import convert, get_recipe

TOKENS = 512
_real = linear.scaled_matmul
_force_bf16 = [False]


def _nonfinite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t.float())).sum())


def _checked(a, b, out_dtype=torch.float32, **kw):
    """linear.scaled_matmul, reporting GEMMs with non-finite FP8 bytes and dgrads (an E5M2 dy of TOKENS rows) with
    a non-finite output."""
    if torch.compiler.is_compiling():
        return _real(a, b, out_dtype, **kw)
    dgrad = a.data.dtype == torch.float8_e5m2 and a.shape[0] == TOKENS
    kind = "dgrad" if dgrad else "wgrad" if a.data.dtype == torch.float8_e5m2 else "fprop"
    y = _real(a, b, torch.bfloat16 if dgrad and _force_bf16[0] else out_dtype, **kw)
    row = dict(a=tuple(a.shape), a_bad=_nonfinite(a.data), b=tuple(b.shape), b_bad=_nonfinite(b.data),
               of=b.data.numel(), a_scale_inv=float(a.scale_inv.float().max()))
    if dgrad:
        filled = torch.full((a.shape[0], b.shape[0]), float("nan"), device=y.device, dtype=torch.bfloat16)
        torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv.float().reshape(()),
                         scale_b=b.scale_inv.float().reshape(()), out_dtype=torch.bfloat16, out=filled)
        row.update(out=str(y.dtype)[6:], out_bad=_nonfinite(y), fp32_bad=_nonfinite(_real(a, b, torch.float32, **kw)),
                   filled_bad=_nonfinite(filled))
    if row["a_bad"] or row["b_bad"] or row.get("out_bad") or row.get("filled_bad"):
        print(f"  {kind}", row, flush=True)
    return y.to(out_dtype)


def grads(recipe: str, force_bf16: bool = False, compiled: bool = False) -> list[str]:
    torch.manual_seed(0)
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512, max_seq_len=128)
    model = Llama(args).cuda()
    convert(model, get_recipe(recipe))
    x = torch.randint(0, 512, (TOKENS // 128, 128), generator=torch.Generator().manual_seed(0)).cuda()
    _force_bf16[0] = force_bf16
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (torch.compile(model) if compiled else model)(x, x).backward()
    torch._dynamo.reset()
    return [n for n, p in model.named_parameters() if not p.grad.isfinite().all()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="fp8-tensorwise,fp8-delayed")
    p.add_argument("--fused-transpose", action="store_true", help="kernels.FUSED_TRANSPOSE on")
    a = p.parse_args()
    kernels.FUSED_TRANSPOSE = a.fused_transpose
    linear.scaled_matmul = _checked
    print(torch.__version__, torch.cuda.get_device_name(), "FUSED_TRANSPOSE", kernels.FUSED_TRANSPOSE, flush=True)
    for recipe in a.recipes.split(","):
        for force, compiled in ((False, False), (True, False), (False, True)):
            bad = grads(recipe, force, compiled)
            print(f"{recipe} {'compiled' if compiled else 'eager'}{', dgrad bf16' if force else ''}: "
                  f"{len(bad)} parameters with non-finite gradients {bad[:4]}", flush=True)


if __name__ == "__main__":
    main()
