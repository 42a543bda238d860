"""FP8-LM optimizer on the `1b` preset (TinyLlama-1.1B shape), one GPU, one process (--preset picks another shape;
the FP4 step of issue 5 is `--preset 350m --no-optimizer-only --recipes bf16,fp8-tensorwise,fp4`):

  1. optimizer step alone: torch's fused AdamW (fp32 states) vs lowbit's fp8lm-o2 storage (bf16 weights, E4M3
     gradients and first moment, scaled FP16 second moment), gradients present, median of --steps steps;
  2. a whole training step (batch 8 x 2048, compiled model, bf16 autocast, clipping, optimizer) and its peak
     memory under bf16, fp8-tensorwise and fp8lm-o2 (and any --recipes).

    python benchmarks/optim_1b.py [--steps 10] [--recipes bf16,fp8-tensorwise,fp8lm-o2] [--preset 1b] [--out F]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time

import torch

from lowbit.models.llama import Llama, resolve_model_args
from lowbit.optim.memory import memory_report
from lowbit.recipes import convert, get_recipe
from lowbit.train.compile import SCOPES, compile_model
from lowbit.train.config import ModelConfig, load_config, optim_precision
from lowbit.train.trainer import build_optimizer

BATCH, SEQ, VOCAB = 8, 2048, 32000
PRESET = "1b"  # set by --preset


def build(recipe_name: str):
    cfg = load_config(None, ["--recipe", recipe_name])
    torch.manual_seed(0)
    model = Llama(resolve_model_args(ModelConfig(preset=PRESET), vocab_size=VOCAB, seq_len=SEQ)).cuda()
    recipe = get_recipe(recipe_name)
    convert(model, recipe)
    return model, build_optimizer(model, recipe, optim_precision(cfg), cfg)


def batch():
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda", generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def timed(fn, steps: int, warmup: int = 3) -> list[float]:
    out = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def optimizer_only(steps: int) -> list[dict]:
    rows = []
    # torch fused AdamW on fp32 parameters, the trainer's default for bf16
    torch.manual_seed(0)
    model = Llama(resolve_model_args(ModelConfig(preset=PRESET), vocab_size=VOCAB, seq_len=SEQ)).cuda()
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    t = timed(opt.step, steps)
    rows.append({"optimizer": "torch AdamW fused (fp32 states)", "ms": statistics.median(t) * 1e3})
    del model, opt
    gc.collect(), torch.cuda.empty_cache()
    model, opt = build("fp8lm-o2")
    x, y = (t[:1, :512] for t in batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, y).backward()  # fills the FP8 gradient stores (kept: step() does not clear them)
    t = timed(opt.step, steps)
    rows.append({"optimizer": "lowbit fp8lm-o2 (compiled update)", "ms": statistics.median(t) * 1e3})
    del model, opt
    gc.collect(), torch.cuda.empty_cache()
    torch._dynamo.reset()
    return rows


def train_step(recipe: str, steps: int, eager: bool = False, scope: str = "blocks") -> dict:
    model, opt = build(recipe)
    compiled = model if eager else compile_model(model, scope)
    x, y = batch()

    reports = []

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, y)
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        if not reports:  # measured while the gradients exist, as the trainer does
            reports.append(memory_report(opt))
        opt.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()  # compiles
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    t = timed(step, steps, warmup=2)
    peak = torch.cuda.max_memory_allocated() / 2**30
    report = reports[0]
    del model, opt, compiled
    gc.collect(), torch.cuda.empty_cache()
    torch._dynamo.reset()
    return {"recipe": recipe + (" (eager)" if eager else ""), "ms_per_step": statistics.median(t) * 1e3, "ms_min": min(t) * 1e3,
            "peak_mem_gib": peak, "bytes_per_param_model": report["model"]["bytes_per_param"]["total"],
            "bytes_per_param_covered": report["covered"]["bytes_per_param"]["total"], "first_step_s": first_s}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--recipes", default="bf16,fp8-tensorwise,fp8lm-o2")
    p.add_argument("--out", default="")
    p.add_argument("--no-optimizer-only", action="store_true", help="skip part 1")
    p.add_argument("--preset", default="1b")
    p.add_argument("--eager", action="store_true", help="no torch.compile (fp4's OCC layers run eagerly anyway)")
    p.add_argument("--compile-scope", default="blocks", choices=SCOPES, help="see lowbit.train.compile")
    a = p.parse_args()
    global PRESET
    PRESET = a.preset
    dev = torch.cuda.get_device_name()
    header = {"device": dev, "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable.split("/")[-1]] + sys.argv), "batch": BATCH, "seq": SEQ,
              "preset": PRESET, "compiled": not a.eager, "compile_scope": a.compile_scope}
    opt_rows = [] if a.no_optimizer_only else optimizer_only(a.steps)
    for r in opt_rows:
        print(json.dumps(r), flush=True)
    rows = []
    for recipe in a.recipes.split(","):
        try:
            rows.append(train_step(recipe, a.steps, a.eager, a.compile_scope))
        except torch.OutOfMemoryError:
            rows.append({"recipe": recipe, "error": "out of memory"})
        except Exception as e:  # one failing recipe must not cost the others' numbers
            rows.append({"recipe": recipe, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
            gc.collect(), torch.cuda.empty_cache()
            torch._dynamo.reset()
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{dev} | torch {torch.__version__} | {header['date']} | `{header['command']}`\n")
    print(f"| optimizer step, {PRESET} | ms (median) |\n|---|---|")
    for r in opt_rows:
        print(f"| {r['optimizer']} | {r['ms']:.2f} |")
    ref = next((r for r in rows if r["recipe"].split()[0] == "fp8-tensorwise" and "error" not in r), None)
    print("\n| recipe | ms/step (median) | vs fp8-tensorwise | peak GiB | bytes/param (model / covered) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['recipe']} | {r['error']} | | | |")
            continue
        rel = f"{r['ms_per_step'] / ref['ms_per_step']:.3f}x" if ref else "n/a"
        print(f"| {r['recipe']} | {r['ms_per_step']:.1f} | {rel} | {r['peak_mem_gib']:.1f} | "
              f"{r['bytes_per_param_model']:.2f} / {r['bytes_per_param_covered']:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"header": header, "optimizer": opt_rows, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
