"""`lowbit bench attention`: causal attention forward and forward + backward per sequence length, SDPA in bf16
(the flash kernel on a GPU) against numerics.fp8_attention (lowbit's Triton FP8 forward with bf16 attention's
backward; on the CPU its emulation: a smoke test, not a measurement). A batch of --tokens tokens at each length
(at least one sequence), --heads heads of --head-dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lowbit.numerics.attention import FP8Attention
from lowbit.tools.bench.common import Report, Table, add_ratios, error_row, release, time_ms


def _sdpa(q, k, v):
    if q.is_cuda:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _passes(fn, q, k, v) -> dict:
    g = torch.randn_like(q)

    def both():
        out = fn(q, k, v)
        return torch.autograd.grad(out, (q, k, v), g)

    def forward():
        with torch.no_grad():
            return fn(q, k, v)

    return {"fwd": forward, "fwd+bwd": both}


def run_attention(a, device: torch.device, report: Report) -> None:
    t = report.table(Table("attention", f"causal attention, {a.tokens} tokens per batch, {a.heads} heads of "
                                        f"{a.head_dim}",
                           [("seq", "seq", ""), ("batch", "batch", ""), ("pass", "pass", ""),
                            ("variant", "variant", ""), ("ms", "ms (median)", ".3f"), ("tflops", "TFLOP/s", ".1f"),
                            ("speedup_vs_bf16", "vs bf16", ".2f")]))
    t.notes.append("FLOPs counted causal (half of 4·B·H·L²·D forward; backward 2.5x the forward). fp8: E4M3 Q, K, "
                   "V and P in the forward (Triton), the backward bf16 flash at the dequantized operands.")
    variants = {"bf16 sdpa" + (" flash" if device.type == "cuda" else ""): _sdpa,
                "lowbit fp8": FP8Attention()}
    for seq in a.seq_list:
        batch = max(1, a.tokens // seq)
        g = torch.Generator(device=device).manual_seed(seq)
        q, k, v = (torch.randn(batch, a.heads, seq, a.head_dim, device=device, generator=g)
                   .to(torch.bfloat16).requires_grad_() for _ in range(3))
        flops = 2 * batch * a.heads * seq * seq * a.head_dim
        rows = []
        for name, fn in variants.items():
            if a.no_bf16 and name.startswith("bf16"):
                continue
            fn = torch.compile(fn) if a.compile else fn
            for pass_name, call in _passes(fn, q, k, v).items():
                row = {"seq": seq, "batch": batch, "pass": pass_name, "variant": name}
                try:
                    row.update(time_ms(call, device, a.steps, a.warmup))
                    row["tflops"] = flops * (1 if pass_name == "fwd" else 3.5) / row["ms"] / 1e9
                except Exception as e:  # a length this device cannot hold is a result too
                    row.update(error_row(e))
                rows.append(row)
        for pass_name in ("fwd", "fwd+bwd"):
            add_ratios([r for r in rows if r["pass"] == pass_name], base=next(iter(variants)))
        for row in rows:
            report.row(t, row)
        del q, k, v
        release(device)
