"""Time of one low-precision linear's forward + backward (median of --steps after warm-up), eager and compiled:
what OCC costs on top of plain FP4 and FP8, and whether torch.compile traces it.

    python benchmarks/occ_linear.py [--device cuda] [--tokens 4096 --dims 768,2048]
        [--recipes fp4,fp4:sparse,fp4-no-occ,fp8-tensorwise] [--modes eager,compiled] [--autocast bf16]
        [--out F.json]

A recipe name with `:dense`, `:fp8` or `:sparse` sets its OCC products (lowbit.numerics.fp4.OCC.products).
--autocast bf16 runs the layer under bf16 autocast, as the trainer does on a GPU (default there; fp32 on the CPU).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from dataclasses import replace

import torch

from lowbit.numerics.linear import LowPrecisionLinear
from lowbit.numerics.recipes import get_recipe
from tables import write  # benchmarks/tables.py: the result file in bench's layout


def time_step(layer, x, dy, steps: int, device: str) -> float:
    def step():
        layer(x).backward(dy)
        layer.weight.grad = None

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dims", default="768,2048")
    p.add_argument("--recipes", default="fp4,fp4-no-occ,fp8-tensorwise")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--autocast", default="", help="bf16 | none (default: bf16 on cuda, none on cpu)")
    p.add_argument("--out", default="", help="the result file (JSON, benchmarks/tables.py's layout)")
    a = p.parse_args()
    header = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python3"] + sys.argv)}
    raw: list[dict] = []
    bf16 = (a.autocast or ("bf16" if a.device.startswith("cuda") else "none")) == "bf16"
    k, n = map(int, a.dims.split(","))
    g = torch.Generator(a.device).manual_seed(0)
    x = torch.randn(a.tokens, k, device=a.device, generator=g)
    x[:, :: k // 8] *= 20  # a few outlier channels, as in LLaMA activations
    dy = torch.randn(a.tokens, n, device=a.device, generator=g)
    print(f"torch {torch.__version__} | {a.device} | {a.tokens} tokens, {k} -> {n} | "
          f"{'bf16 autocast' if bf16 else 'fp32'}")
    for recipe in a.recipes.split(","):
        name, _, products = recipe.partition(":")
        linear = get_recipe(name).linear
        if products and linear.occ is not None:
            linear = replace(linear, occ=replace(linear.occ, products=products))
        for mode in a.modes.split(","):
            torch._dynamo.reset()
            layer = LowPrecisionLinear.from_linear(torch.nn.Linear(k, n, bias=False, device=a.device), linear)
            fwd = torch.compile(layer, fullgraph=True) if mode == "compiled" else layer
            t = time.perf_counter()
            with torch.autocast(a.device.split(":")[0], dtype=torch.bfloat16, enabled=bf16):
                ms = time_step(fwd, x, dy.to(torch.bfloat16) if bf16 else dy, a.steps, a.device)
            print(f"{recipe:16s} {mode:9s} {ms:9.1f} ms fwd+bwd   (first 2 steps + {a.steps} timed: "
                  f"{time.perf_counter() - t:.0f} s)", flush=True)
            raw.append({"recipe": recipe, "mode": mode, "ms": ms})
    write(a.out, header, raw, "occ", OCC_COLUMNS, occ_rows(raw))


OCC_COLUMNS = [("recipe", "recipe"), ("eager", "eager ms"), ("compiled", "compiled ms"),
               ("vs", "compiled vs fp8-tensorwise")]


def occ_rows(raw: list[dict]) -> list[dict]:
    """BENCHMARKS.md's table (benchmarks/tables.py): one line per recipe, its compiled time over fp8-tensorwise's."""
    ms = {(r["recipe"], r["mode"]): r["ms"] for r in raw}
    base = ms.get(("fp8-tensorwise", "compiled"))
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in raw):
        row = {"recipe": recipe}
        for mode in ("eager", "compiled"):
            if (recipe, mode) in ms:
                row[mode] = f"{ms[recipe, mode]:.1f}"
        if base and (recipe, "compiled") in ms:
            row["vs"] = f"{ms[recipe, 'compiled'] / base:.2f}x"
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
