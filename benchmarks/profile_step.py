"""Where a training step's GPU time goes: one step of `--preset` under `--recipe` (eager or compiled), profiled
after two warm-up steps; prints the top operators by CUDA time (self), as BENCHMARKS.md quotes them.

    python benchmarks/profile_step.py --preset 350m --recipes fp4,fp8-tensorwise [--compile] [--rows 15]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys

import torch

import optim_1b  # same model, batch and optimizer as the step benchmark


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="350m")
    p.add_argument("--recipes", default="fp4")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--rows", type=int, default=15)
    a = p.parse_args()
    optim_1b.PRESET = a.preset
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')} | "
          f"`python {' '.join(sys.argv)}`")
    for recipe in a.recipes.split(","):
        model, opt = optim_1b.build(recipe)
        fwd = torch.compile(model) if a.compile else model
        x, y = optim_1b.batch()

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels) / 1e3
        print(f"\n### {recipe} ({'compiled' if a.compile else 'eager'}): {total:.1f} ms of GPU kernel time in the "
              f"step\n")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=a.rows, max_name_column_width=60))
        del model, opt, fwd
        gc.collect(), torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
