"""`lowbit bench linear | mlp | block`: one module's forward + backward under bf16, each lowbit recipe and each
torchao float8 recipe, in one process: a linear layer, the SwiGLU MLP (LLaMA-7B's by default), a LLaMA Block."""

from __future__ import annotations

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.tools.bench.common import (MLP, Report, Table, add_ratios, apply_variant, error_row, maybe_compile, release,
                                       time_ms, variants)


class BlockWithRope(nn.Module):
    """One lowbit LLaMA Block and its rotary tables: forward(x) for x [batch, seq, dim]."""

    def __init__(self, args):
        super().__init__()
        from lowbit.models.llama import Block, rope_tables

        self.block = Block(args)
        cos, sin = rope_tables(args.head_dim, args.max_seq_len, args.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, 0.0, args.init_std)

    def forward(self, x):
        L = x.shape[1]
        return self.block(x, self.cos[:L], self.sin[:L])


def preset_args(preset: str, seq: int, vocab: int = 32000):
    """ModelArgs of a preset; the checks name bench's options (the library's name the config's keys)."""
    from lowbit.models.llama import PRESETS, resolve_model_args
    from lowbit.train.config import ModelConfig

    if preset not in PRESETS:
        raise LowbitError(f"bench: --preset {preset!r} is not one of {', '.join(PRESETS)}")
    fixed = PRESETS[preset].get("vocab_size")
    if fixed and vocab > fixed:
        raise LowbitError(f"bench: --vocab {vocab} is above the fixed vocabulary of preset {preset!r} ({fixed})")
    return resolve_model_args(ModelConfig(preset=preset), vocab_size=vocab, seq_len=seq)


def time_fwd_bwd(base: nn.Module, x: torch.Tensor, a, device: torch.device, report: Report, t: Table,
                 flops: float) -> None:
    """One row per variant: median ms of module(x).backward(dy) (grads cleared first), compiled unless --eager;
    TFLOP/s from `flops` (forward + backward), speed-up against the bf16 row of this table."""
    g = torch.Generator(device=device).manual_seed(1)
    dy = None
    for v in variants(a.recipe_list, a.torchao_list):
        row = {"variant": v.name}
        try:
            m = apply_variant(base, v)
            fn_module = maybe_compile(m, a.compile)
            if dy is None:
                with torch.no_grad():
                    shape = m(x).shape
                dy = torch.randn(shape, device=device, generator=g).to(x.dtype)

            def step():
                # set_to_none, not zeroing: backward then writes fresh grads, with no accumulate kernel in the time
                x.grad = None
                m.zero_grad(set_to_none=True)
                fn_module(x).backward(dy)

            row.update(time_ms(step, device, a.steps, a.warmup))
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as e:  # one failing variant must not cost the others' numbers
            row.update(error_row(e))
        finally:
            m = fn_module = None
            x.grad = None
            release(device)
        report.row(t, row)
    add_ratios(t.rows)
    report.save(complete=False)


def _columns():
    return [("variant", "variant", ""), ("ms", "ms (median)", ".3f"), ("tflops", "TFLOP/s", ".1f"),
            ("speedup_vs_bf16", "speed-up vs bf16", ".2f")]


def _mode(a) -> str:
    return "compiled" if a.compile else "eager"


def run_linear(a, device: torch.device, report: Report) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(a.dim, a.hidden, bias=False)).to(device, torch.bfloat16)
    x = torch.randn(a.tokens, a.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    t = report.table(Table("linear", f"linear {a.dim} -> {a.hidden}, {a.tokens} tokens, fwd+bwd, {_mode(a)}",
                           _columns()))
    time_fwd_bwd(base, x, a, device, report, t, 6 * a.tokens * a.dim * a.hidden)


def run_mlp(a, device: torch.device, report: Report) -> None:
    torch.manual_seed(0)
    base = MLP(a.dim, a.hidden).to(device, torch.bfloat16)
    x = torch.randn(a.tokens, a.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    t = report.table(Table("mlp", f"SwiGLU MLP {a.dim} -> {a.hidden} -> {a.dim}, {a.tokens} tokens, fwd+bwd, "
                                  f"{_mode(a)}", _columns()))
    time_fwd_bwd(base, x, a, device, report, t, 3 * 6 * a.tokens * a.dim * a.hidden)
    del base, x
    release(device)
    if not a.no_quantize:
        from lowbit.tools.bench.kernels import run_quantize

        run_quantize(a, device, report)


def run_block(a, device: torch.device, report: Report) -> None:
    torch.manual_seed(0)
    args = a.model_args
    base = BlockWithRope(args).to(device, torch.bfloat16)
    x = torch.randn(a.batch, a.seq, args.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    matmul_params = sum(m.weight.numel() for m in base.modules() if isinstance(m, nn.Linear))
    flops = a.batch * a.seq * (6 * matmul_params + 12 * args.dim * a.seq)  # as Llama.flops_per_token, one block
    t = report.table(Table("block", f"LLaMA block of `{a.preset}`, {a.batch} x {a.seq} tokens, fwd+bwd, {_mode(a)}",
                           _columns()))
    time_fwd_bwd(base, x, a, device, report, t, flops)
