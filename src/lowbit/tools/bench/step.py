"""`lowbit bench step`: a whole training step of a preset (forward, loss, backward, gradient clipping, optimizer) per
recipe, as the trainer runs it: LowbitAdamW with the recipe's state precision, bf16 autocast on a GPU; tokens/s,
MFU from the model's FLOPs/token, peak memory."""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from lowbit.numerics.scaling_state import reports_held
from lowbit.tools.bench import profile
from lowbit.tools.bench.common import (Report, Table, back_to_back_ms, error_row, release, sync, time_ms,
                                       torchao_convert, variants)
from lowbit.train.compile import compile_model


def build(args, v, device: torch.device, model: torch.nn.Module | None = None):
    """Model of ModelArgs `args` (or `model`, a module already on `device`), converted as the variant says, and
    the trainer's optimizer for it."""
    from lowbit.models.init import materialize
    from lowbit.models.llama import Llama
    from lowbit.numerics.recipes import convert
    from lowbit.tools.compare import split_entry
    from lowbit.train.plan import load_config, resolve_recipe
    from lowbit.train.trainer import build_optimizer

    recipe_name, overrides = split_entry(v.recipe) if v.impl == "lowbit" else ("bf16", [])
    cfg = load_config(None, ["--recipe", recipe_name, *overrides])
    torch.manual_seed(0)
    if model is None:
        args = dataclasses.replace(args, checkpointing=cfg.model.checkpointing, sdpa_backend=cfg.model.sdpa_backend)
        with torch.device("meta"):  # built without memory, initialized where it trains (seconds at 7b)
            model = Llama(args)
        materialize(model, device)
    recipe = resolve_recipe(cfg)  # the [numerics] and [optim] settings of a variant, as the trainer takes them
    convert(model, recipe)
    if v.impl == "torchao":
        model = torchao_convert(model, v.recipe)
    return model, build_optimizer(model, recipe, recipe.optim, cfg)


def batch(b: int, seq: int, vocab: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, vocab, (b, seq + 1), device=device, generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def autocast(device: torch.device):
    """bf16 autocast on a GPU (the trainer's default there); fp32 on the CPU (its default there)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def _tables(a, device: torch.device, report: Report) -> tuple[Table, Table | None]:
    """The step table and, with --profile, the profile table."""
    mode = f"compiled ({a.compile_scope})" if a.compile else "eager"
    t = report.table(Table("step", f"training step `{a.preset}`, {a.batch} x {a.seq}, {mode}",
                           [("variant", "variant", ""), ("ms", "ms/step (median)", ".1f"),
                            ("tokens_per_s", "tokens/s", ",.0f"), ("mfu_pct", "MFU %", ".1f"),
                            ("speedup_vs_bf16", "vs bf16", ".3f"), ("vs_fp8_tensorwise", "ms vs fp8-tensorwise", ".3f"),
                            ("ms_in_a_row", "ms/step in a row", ".1f"), ("mfu_in_a_row_pct", "MFU % in a row", ".1f"),
                            ("speedup_in_a_row_vs_bf16", "vs bf16 in a row", ".3f"),
                            ("peak_mem_gib", "peak GiB", ".2f"), ("reserved_gib", "reserved GiB", ".2f"),
                            ("build_s", "build s", ".1f"), ("first_step_s", "first step s", ".1f")]))
    prof = report.table(Table("profile", f"where the step's time goes (`{a.preset}`, {mode}; ms)",
                              profile.columns(device))) if a.profile else None
    return t, prof


def _relative(t: Table) -> None:
    """Each row's speed against bf16's (alone and in a row) and its time against fp8-tensorwise's."""
    ref = {r["variant"]: r["ms"] for r in t.rows if "ms" in r}
    bf16_row = next((r for r in t.rows if r["variant"] == "bf16"), {})
    for r in t.rows:
        if "ms" in r:
            if "bf16" in ref:
                r["speedup_vs_bf16"] = ref["bf16"] / r["ms"]
            if r.get("ms_in_a_row") and bf16_row.get("ms_in_a_row"):
                r["speedup_in_a_row_vs_bf16"] = bf16_row["ms_in_a_row"] / r["ms_in_a_row"]
            if "lowbit fp8-tensorwise" in ref:
                r["vs_fp8_tensorwise"] = r["ms"] / ref["lowbit fp8-tensorwise"]


def _notes(t: Table, prof: Table | None, peak: float | None) -> None:
    """The tables' notes: what the profile measures, the MFU peak."""
    if prof:
        prof.notes.append("Phases: CUDA events between forward (with the loss), backward (with the gradient hooks) "
                          "and clipping + optimizer step + zero_grad, medians over --steps. Kernels: one profiled "
                          "step, kernel time by kind (lowbit.tools.bench.profile.kind: GEMM, attention, "
                          "quantization alone, quantization fused into work bf16 does too, other fused, other); "
                          "GPU idle: the timed step less "
                          "the profiled step's kernel-busy time (the GPU waited for the host); the JSON lists the "
                          "top kernels.")
    if peak:
        t.notes.append(f"MFU against {peak / 1e12:.0f} TFLOP/s dense BF16; FLOPs/token from Llama.flops_per_token.")


def _kinds(a, prof: Table | None, report: Report) -> None:
    """On a GPU, the profile's kernel time by kind with a column per variant (the table `profile_kinds`)."""
    if prof and any("gemm_ms" in r for r in prof.rows):
        report.table(profile.kinds_table(prof.rows, f"kernel time by kind (`{a.preset}`, {a.batch} x {a.seq}), ms"))


def run_step(a, device: torch.device, report: Report) -> None:
    from lowbit.train.metrics import gpu_peak_flops

    peak = gpu_peak_flops(device)
    t, prof = _tables(a, device, report)
    x, y = batch(a.batch, a.seq, a.vocab, device)
    for v in variants(a.recipe_list, a.torchao_list):
        row, prow = {"variant": v.name}, {"variant": v.name}
        profiling = False  # an error from here on is the profile's, not the step's
        model = opt = None
        try:
            t0 = time.perf_counter()
            model, opt = build(a.model_args, v, device)
            sync(device)
            row["build_s"] = time.perf_counter() - t0  # on meta, then initialized on the device
            fwd = compile_model(model, a.compile_scope) if a.compile else model

            def forward():
                with autocast(device):
                    return fwd(x, y)

            def optimizer():
                opt.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

            def backward(loss):
                with reports_held():  # the scaling reports recorded after backward, as the trainer's step does
                    loss.backward()

            def step():
                backward(forward())
                optimizer()

            def trainer_step():  # as the trainer's loop: the loss and norm read (a sync) before the update
                loss = forward()
                backward(loss)
                norm = opt.clip_grad_norm_(1.0)
                if math.isfinite(loss.item()) and math.isfinite(norm.item()):
                    opt.step()
                opt.zero_grad(set_to_none=True)

            t0 = time.perf_counter()
            step()  # the first step compiles and allocates the optimizer states
            sync(device)
            row["first_step_s"] = time.perf_counter() - t0
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            row.update(time_ms(step, device, a.steps, a.warmup))
            flops = model.flops_per_token(a.seq)
            row["tokens_per_s"] = a.batch * a.seq / (row["ms"] / 1e3)
            row["flops_per_token"] = flops
            row["mfu_pct"] = 100 * row["tokens_per_s"] * flops / peak if peak else None
            # steps in a row: the next step's launches overlap this one's update, as in training
            row["ms_in_a_row"] = back_to_back_ms(trainer_step, device, a.steps)
            row["mfu_in_a_row_pct"] = row["mfu_pct"] * row["ms"] / row["ms_in_a_row"] if peak else None
            if device.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                # held by the allocator, CUDA graph pools included (their blocks are not "allocated" between replays)
                row["reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
            if prof:
                profiling = True
                prow["step_ms"] = row["ms"]
                prow.update(profile.phase_ms(forward, backward, optimizer, device, a.steps))
                prow.update(profile.kernel_ms(step, device))
                if "busy_ms" in prow:
                    prow["idle_ms"] = profile.idle(row["ms"], prow["busy_ms"])
        except Exception as e:
            (prow if profiling else row).update(error_row(e))
        finally:
            model = opt = fwd = None
            release(device)
        report.row(t, row)
        if profiling:
            report.row(prof, prow)
    _relative(t)
    _notes(t, prof, peak)
    _kinds(a, prof, report)
    report.save(complete=False)
