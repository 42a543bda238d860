"""The Triton optimizer update's launch shape and math, swept on a preset's parameters (a GPU).

For each recipe, LowbitAdamW is built once as `lowbit bench optim` builds it; then each configuration of
src/lowbit/optim/update_kernel.py (elements per load, loads per program, warps, blocks in flight through Triton's
pipeliner, approximate sqrt and reciprocal in the weight's step, the weights' scale certified by bounds) times `step()` alone and ten steps back to back
(the kernels' time when the host launches ahead). GB/s counts the bytes the update must move (bench optim's
`update_bytes`). The first row of each recipe after the baseline (an earlier update_kernel.py timed on the same
build, where --baseline names one) is the configuration the library shipped when the sweep ran; the note under
the table names the one it ships now.

    git show f58d11e:src/lowbit/optim/update_kernel.py > /tmp/update_kernel_f58d11e.py
    python benchmarks/optim_kernel_sweep.py --preset 7b --baseline /tmp/update_kernel_f58d11e.py \
        --out benchmarks/results/optim_kernel_sweep_7b_h100.json
    python benchmarks/optim_kernel_sweep.py --table RESULT.json  # rewrite an older file's table from its rows
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from tables import write  # benchmarks/tables.py: the result file in bench's layout

from lowbit.optim import update_kernel
from lowbit.tools.bench.common import GPU_HBM_BYTES_PER_S, back_to_back_ms, device_name, release, time_ms, variants
from lowbit.tools.bench.layers import preset_args
from lowbit.tools.bench.optim import fill_grads, update_bytes
from lowbit.tools.bench.step import build

# (elements per load, loads per program, warps, stages, approximate math, certified weight scales, a chunk's
# tensors in one launch per pass): 16, 8 or 4 elements per thread, pipelined
CONFIGS = [(2048, 8, 8, 3, True, True, True), (2048, 8, 8, 3, True, True, False),
           (2048, 8, 8, 3, True, False, True), (2048, 8, 8, 3, True, False, False),
           (1024, 16, 8, 3, True, True, True), (1024, 16, 4, 3, True, True, True), (2048, 8, 8, 2, True, True, True),
           (512, 32, 4, 3, True, True, True), (1024, 16, 8, 1, True, True, True), (2048, 16, 8, 3, True, True, True),
           (4096, 8, 16, 3, True, True, True), (1024, 8, 4, 2, True, True, True), (2048, 8, 8, 1, True, True, True),
           (2048, 8, 8, 1, False, True, True), (4096, 4, 8, 3, True, True, True), (4096, 8, 8, 2, True, True, True)]
KNOBS = ("BLOCK", "ITERS", "WARPS", "STAGES", "FAST", "CERTIFY", "GROUP")


def moved_bytes(opt) -> int:
    """The bytes one update must move (bench optim's measure)."""
    return sum(p.numel() * update_bytes(opt.precision_of(g)) for g in opt.param_groups for p in g["params"])


def timed(opt, moved: int, hbm: float | None, **row) -> dict:
    """One configuration's row: the first step (its kernels built), the step alone and back to back."""
    opt._graphed.clear()  # the update's CUDA graph holds the kernels it captured: capture this configuration's
    t0 = time.perf_counter()
    opt.step()
    row["first_step_s"] = time.perf_counter() - t0
    row["ms"] = time_ms(opt.step, torch.device("cuda"), 5, 1)["ms"]
    row["ms_back_to_back"] = back_to_back_ms(opt.step, torch.device("cuda"), 10)
    row["gb_per_s"] = moved / (row["ms_back_to_back"] / 1e3) / 1e9
    if hbm:
        row["hbm_pct"] = 100 * row["gb_per_s"] * 1e9 / hbm
    print(json.dumps(row), flush=True)
    return row


def older(path: str):
    """An earlier update_kernel.py (`git show REV:src/lowbit/optim/update_kernel.py > FILE`), loaded beside
    the current one: its `update` runs in place of the current one's, with its own launch constants."""
    spec = importlib.util.spec_from_file_location("lowbit_update_kernel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sweep(recipe: str, preset: str, hbm: float | None, baseline: str | None = None,
          configs: list[tuple] = CONFIGS) -> list[dict]:
    (v,) = variants([recipe], [])
    model, opt = build(preset_args(preset, 2048), v, torch.device("cuda"))
    fill_grads(opt)
    moved, rows = moved_bytes(opt), []
    default = tuple(getattr(update_kernel, k) for k in KNOBS)
    configs = [default] + [c for c in configs if c != default]
    with update_kernel.forced(True):
        if baseline:
            old, current = older(baseline), update_kernel.update
            update_kernel.update = old.update
            try:
                rows.append(timed(opt, moved, hbm, recipe=recipe, block=old.BLOCK, iters=old.ITERS,
                                  warps=old.WARPS, stages=1, fast=old.FAST, certify=False, group=False, kernels=baseline))
            finally:
                update_kernel.update = current
                for record in opt._amax.values():  # the earlier kernels wrote states without recording them
                    record.zero_()
        try:
            for config in configs:
                for k, value in zip(KNOBS, config):
                    setattr(update_kernel, k, value)
                block, iters, warps, stages, fast, certify, group = config
                rows.append(timed(opt, moved, hbm, recipe=recipe, block=block, iters=iters, warps=warps,
                                  stages=stages, fast=fast, certify=certify, group=group))
        finally:
            for k, value in zip(KNOBS, default):
                setattr(update_kernel, k, value)
    model = opt = None
    release(torch.device("cuda"))
    return rows


def math(fast: bool) -> str:
    return "approximate" if fast else "correctly rounded"


def cells(r: dict) -> dict:
    shape = f"{r['block']} x {r['iters']}, {r['warps']} warps, {r.get('stages', 1)} in flight"
    if r.get("kernels"):  # an earlier update_kernel.py's row
        shape += f" ({Path(r['kernels']).stem})"
    return dict(recipe=r["recipe"], shape=shape, math=math(r["fast"]), certify="yes" if r.get("certify") else "no",
                group="a chunk" if r.get("group") else "one tensor",
                ms=f"{r['ms']:.1f}", b2b=f"{r['ms_back_to_back']:.1f}", gbs=f"{r['gb_per_s']:,.0f}",
                hbm=f"{r['hbm_pct']:.1f}" if "hbm_pct" in r else "")


COLUMNS = [("recipe", "optimizer update, Triton kernels"),
           ("shape", "elements per load x loads, warps, blocks in flight"),
           ("math", "sqrt and division in the weight's step"),
           ("certify", "weights' scale certified (amax scales)"), ("group", "tensors per launch"),
           ("ms", "ms (step alone)"),
           ("b2b", "ms back to back"), ("gbs", "GB/s"), ("hbm", "% of HBM")]
NOTE = ("The library ships {block} x {iters}, {warps} warps, {stages} in flight, {math} math, weights' scales "
        "{certify}, {group} per launch (update_kernel.BLOCK, ITERS, WARPS, STAGES, FAST, CERTIFY, GROUP). "
        "A chunk: the tensors of one shape the optimizer updates together (up to adamw.CHUNK), one launch per pass, "
        "each program reading its tensor's addresses from a table. "
        "Certified: under amax scales, the weights' amax pass skipped where bounds fix their scale (the same bytes). "
        "GB/s: the bytes the update must move (bench optim's measure) over the back-to-back time.")


def note() -> str:
    k = update_kernel
    return NOTE.format(block=k.BLOCK, iters=k.ITERS, warps=k.WARPS, stages=k.STAGES, math=math(k.FAST),
                       certify="certified where bounds fix them" if k.CERTIFY else "from their amax",
                       group="a chunk's tensors" if k.GROUP else "one tensor")


def save(out: str, meta: dict, rows: list[dict]) -> None:
    write(out, meta, rows, "sweep", COLUMNS, [cells(r) for r in rows], (note(),))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="7b")
    ap.add_argument("--recipes", default="fp8lm-o2+optim.scales=bound,fp8lm-o2,fp8lm-o2+optim.scales=mixed")
    ap.add_argument("--out")
    ap.add_argument("--baseline", help="an earlier update_kernel.py, timed first in each recipe's build")
    ap.add_argument("--configs", type=int, default=len(CONFIGS), help="the first N of CONFIGS only")
    ap.add_argument("--table", help="a result file whose table is rewritten from its rows")
    a = ap.parse_args()
    if a.table:
        doc = json.load(open(a.table))
        save(a.table, doc.get("header") or doc["meta"], doc["rows"])
        return
    name = device_name(torch.device("cuda"))
    hbm = next((bw for k, bw in GPU_HBM_BYTES_PER_S.items() if k in name), None)
    rows = [r for recipe in a.recipes.split(",") for r in sweep(recipe, a.preset, hbm, a.baseline,
                                                                  CONFIGS[:a.configs])]
    meta = dict(device=name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"), preset=a.preset,
                command="python benchmarks/optim_kernel_sweep.py " + " ".join(sys.argv[1:]))
    save(a.out, meta, rows)


if __name__ == "__main__":
    main()
