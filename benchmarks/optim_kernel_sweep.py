"""The Triton optimizer update's launch shape and math, swept on a preset's parameters (a GPU).

For each recipe, LowbitAdamW is built once as `lowbit bench optim` builds it; then each configuration of
src/lowbit/optim/update_kernel.py (elements per load, loads per program, warps, blocks in flight through Triton's
pipeliner, approximate sqrt and division in the weight's step) times `step()` alone and ten steps back to back
(the kernels' time when the host launches ahead). GB/s counts the bytes the update must move (bench optim's `update_bytes`). The configuration the library
ships is the first row of each recipe (the note under the table names it).

    python benchmarks/optim_kernel_sweep.py --preset 7b --out benchmarks/results/optim_kernel_sweep_7b_h100.json
    python benchmarks/optim_kernel_sweep.py --table RESULT.json  # rewrite an older file's table from its rows
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tables import write  # benchmarks/tables.py: the result file in bench's layout

from lowbit.optim import update_kernel
from lowbit.tools.bench.common import GPU_HBM_BYTES_PER_S, back_to_back_ms, device_name, release, time_ms, variants
from lowbit.tools.bench.layers import preset_args
from lowbit.tools.bench.optim import fill_grads, update_bytes
from lowbit.tools.bench.step import build

# (elements per load, loads per program, warps, stages, approximate math): 8 or 4 elements per thread, pipelined
CONFIGS = [(2048, 8, 8, 1, False), (2048, 8, 8, 1, True), (2048, 8, 8, 2, True), (2048, 8, 8, 3, True),
           (2048, 16, 8, 3, True), (1024, 16, 4, 3, True), (1024, 16, 8, 1, True), (1024, 16, 8, 3, True),
           (512, 32, 4, 3, True), (4096, 8, 16, 3, True), (1024, 8, 4, 2, True)]
KNOBS = ("BLOCK", "ITERS", "WARPS", "STAGES", "FAST")


def moved_bytes(opt) -> int:
    """The bytes one update must move (bench optim's measure)."""
    return sum(p.numel() * update_bytes(opt.precision_of(g)) for g in opt.param_groups for p in g["params"])


def sweep(recipe: str, preset: str, hbm: float | None) -> list[dict]:
    (v,) = variants([recipe], [])
    model, opt = build(preset_args(preset, 2048), v, torch.device("cuda"))
    fill_grads(opt)
    moved, rows = moved_bytes(opt), []
    default = tuple(getattr(update_kernel, k) for k in KNOBS)
    configs = [default] + [c for c in CONFIGS if c != default]
    with update_kernel.forced(True):
        for config in configs:
            for k, value in zip(KNOBS, config):
                setattr(update_kernel, k, value)
            block, iters, warps, stages, fast = config
            opt._graphed.clear()  # the update's CUDA graph holds the kernels it captured: capture this config's
            t0 = time.perf_counter()
            opt.step()
            first = time.perf_counter() - t0
            alone = time_ms(opt.step, torch.device("cuda"), 5, 1)["ms"]
            row = dict(recipe=recipe, block=block, iters=iters, warps=warps, stages=stages, fast=fast, ms=alone,
                       ms_back_to_back=back_to_back_ms(opt.step, torch.device("cuda"), 10), first_step_s=first)
            row["gb_per_s"] = moved / (row["ms_back_to_back"] / 1e3) / 1e9
            if hbm:
                row["hbm_pct"] = 100 * row["gb_per_s"] * 1e9 / hbm
            rows.append(row)
            print(json.dumps(row), flush=True)
    for k, value in zip(KNOBS, default):
        setattr(update_kernel, k, value)
    model = opt = None
    release(torch.device("cuda"))
    return rows


def math(fast: bool) -> str:
    return "approximate" if fast else "correctly rounded"


def cells(r: dict) -> dict:
    shape = f"{r['block']} x {r['iters']}, {r['warps']} warps, {r.get('stages', 1)} in flight"
    return dict(recipe=r["recipe"], shape=shape, math=math(r["fast"]),
                ms=f"{r['ms']:.1f}", b2b=f"{r['ms_back_to_back']:.1f}", gbs=f"{r['gb_per_s']:,.0f}",
                hbm=f"{r['hbm_pct']:.1f}" if "hbm_pct" in r else "")


COLUMNS = [("recipe", "optimizer update, Triton kernels"),
           ("shape", "elements per load x loads, warps, blocks in flight"),
           ("math", "sqrt and division in the weight's step"), ("ms", "ms (step alone)"),
           ("b2b", "ms back to back"), ("gbs", "GB/s"), ("hbm", "% of HBM")]
NOTE = ("The library ships {block} x {iters}, {warps} warps, {stages} in flight, {math} math (update_kernel.BLOCK, "
        "ITERS, WARPS, STAGES, FAST). "
        "GB/s: the bytes the update must move (bench optim's measure) over the back-to-back time.")


def note() -> str:
    k = update_kernel
    return NOTE.format(block=k.BLOCK, iters=k.ITERS, warps=k.WARPS, stages=k.STAGES, math=math(k.FAST))


def save(out: str, meta: dict, rows: list[dict]) -> None:
    write(out, meta, rows, "sweep", COLUMNS, [cells(r) for r in rows], (note(),))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--recipes", default="fp8lm-o2+optim.scales=bound,fp8lm-o2,fp8lm-o2+optim.scales=mixed")
    ap.add_argument("--out")
    ap.add_argument("--table", help="a result file whose table is rewritten from its rows")
    a = ap.parse_args()
    if a.table:
        doc = json.load(open(a.table))
        save(a.table, doc.get("header") or doc["meta"], doc["rows"])
        return
    name = device_name(torch.device("cuda"))
    hbm = next((bw for k, bw in GPU_HBM_BYTES_PER_S.items() if k in name), None)
    rows = [r for recipe in a.recipes.split(",") for r in sweep(recipe, a.preset, hbm)]
    meta = dict(device=name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"), preset=a.preset,
                command=f"python benchmarks/optim_kernel_sweep.py --preset {a.preset} --out {a.out}")
    save(a.out, meta, rows)


if __name__ == "__main__":
    main()
