"""Context-parallel attention on one GPU: the ring's block schedule (every cp rank's blocks, run one after another on
this device by `OneDeviceRing`, no process group) against one SDPA flash call over the same tokens, and the `1b`
model's memory per token with that schedule as its attention core, which `cp_memory.py` turns into the longest
sequence each layout should fit.

    python benchmarks/ring_attention.py [--lengths 32768,65536,131072] [--cps 2,4] [--model-lengths 8192,16384]
                                        [--policies none,selective,full] [--out ring_attention.json]

attention: heads and head dim of the `1b` preset (32 x 64; its 4 K/V heads are repeated before the core, as the
model does), batch 1, bf16, causal; forward + backward, the median of --reps timed runs after one warm-up (CUDA
events). Peak memory is above the inputs (and the reference's output and gradients, kept to compare). Errors: the largest |ring - SDPA| of the output and
each gradient, and that over the largest |SDPA| (SDPA's own bf16 rounding is of the same order).
model: the whole `1b` model, bf16 autocast, fp32 weights, gradients and AdamW moments (16 bytes per parameter, the
bf16 recipe's), one sequence per step at each --model-lengths under each checkpointing policy. `fixed` is what is
allocated before a step (weights, gradients, optimizer states), `peak` the most allocated during forward + backward.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lowbit.distributed.context_parallel import OneDeviceRingCore, shard_positions
from lowbit.distributed.ring_blocks import OneDeviceRing
from lowbit.models.init import materialize
from lowbit.models.llama import PRESETS, Llama, ModelArgs

HEADS, HEAD_DIM = 32, 64
DEVICE = "cuda"


def timed(fn, reps: int) -> tuple[float, int]:
    """Median ms of fn() over reps runs after a warm-up, and the peak bytes allocated above the start."""
    times = []
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for i in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def _sdpa(a, b, c):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)


def _errors(got: list, ref: list) -> dict:
    names = ("out", "dq", "dk", "dv")
    err = {n: (x.float() - y.float()).abs().max().item() for n, x, y in zip(names, got, ref)}
    return dict(max_err={n: f"{e:.2e}" for n, e in err.items()},
                rel_err={n: f"{err[n] / y.float().abs().max().item():.2e}" for n, y in zip(names, ref)})


def rows_at(L: int, cps: list[int], layouts: list[str], reps: int) -> list[dict]:
    """SDPA flash, then the ring's schedule for each cp and layout, on the same bf16 inputs of L tokens."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v, dout = (torch.randn(1, HEADS, L, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16, generator=g)
                     for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def clear():
        for t in leaves:
            t.grad = None

    def run(attend):
        clear()
        out = attend(*leaves)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    ms, peak = timed(lambda: run(_sdpa), reps)
    ref = [t.clone() for t in run(_sdpa)]  # held while the ring runs: inside its base, not its peak
    rows = [dict(length=L, impl="sdpa-flash", cp=1, layout="-", ms=round(ms, 2), peak_gib=peak / 2**30)]
    print(json.dumps(rows[-1]), flush=True)
    for cp in cps:
        for layout in layouts:
            pos = torch.stack([shard_positions(L, cp, r, layout) for r in range(cp)])
            ring = lambda a, b, c, pos=pos: OneDeviceRing.apply(a, b, c, pos, True)  # noqa: E731
            clear()  # every timing starts without gradients, as SDPA's did
            ms_r, peak_r = timed(lambda: run(ring), reps)
            rows.append(dict(length=L, impl="ring", cp=cp, layout=layout, ms=round(ms_r, 2),
                             vs_sdpa=round(ms_r / ms, 3), peak_gib=peak_r / 2**30, **_errors(run(ring), ref)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def attention_rows(lengths: list[int], cps: list[int], layouts: list[str], reps: int) -> list[dict]:
    rows = []
    for L in lengths:
        rows += rows_at(L, cps, layouts, reps)
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def model_rows(lengths: list[int], policies: list[str], cp: int) -> list[dict]:
    rows = []
    preset = {k: v for k, v in PRESETS["1b"].items() if k != "ffn_multiple_of"}
    args = ModelArgs(**preset, max_seq_len=max(lengths))
    with torch.device("meta"):  # built without memory, initialized on the GPU
        model = Llama(args)
    materialize(model, torch.device(DEVICE))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    for policy in policies:
        for blk in model.layers:
            blk.checkpointing = policy
        for L in lengths:
            for m in model.modules():
                if hasattr(m, "wq"):
                    m.core = OneDeviceRingCore(cp, L)
            x = torch.randint(0, args.vocab_size, (1, L), device=DEVICE)

            def step():
                with torch.autocast(DEVICE, dtype=torch.bfloat16):
                    loss = model(x, x)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of `fixed`

            step()  # allocates gradients and optimizer states
            torch.cuda.synchronize()
            fixed = torch.cuda.memory_allocated()
            ms, peak = timed(step, 1)
            rows.append(dict(policy=policy, length=L, cp_schedule=cp, ms=round(ms, 1), fixed_gib=fixed / 2**30,
                             peak_above_fixed_gib=peak / 2**30, params=sum(p.numel() for p in model.parameters())))
            print(json.dumps(rows[-1]), flush=True)
            del x
            gc.collect()
            torch.cuda.empty_cache()
    return rows


ATTENTION_COLUMNS = [["length", "tokens", ",d"], ["variant", "schedule", ""], ["ms", "fwd+bwd ms", ".2f"],
                     ["vs_sdpa", "vs SDPA flash", ".3f"], ["peak_gib", "peak GiB above inputs", ".2f"],
                     ["rel_out", "rel. err out", ""], ["rel_dq", "dQ", ""], ["rel_dk", "dK", ""], ["rel_dv", "dV", ""]]
MODEL_COLUMNS = [["policy", "checkpointing", ""], ["length", "tokens", ",d"], ["ms", "step ms", ".1f"],
                 ["fixed_gib", "fixed GiB", ".2f"], ["peak_above_fixed_gib", "peak above fixed GiB", ".2f"]]


def tables(report: dict) -> dict:
    """The report's rows as benchmarks/report.py renders them (the "tables" of a `lowbit bench` JSON)."""
    att = [dict(length=r["length"], ms=r["ms"], peak_gib=r["peak_gib"], vs_sdpa=r.get("vs_sdpa"),
                variant="SDPA flash, one call" if r["impl"] == "sdpa-flash" else f"ring cp{r['cp']} {r['layout']}",
                **{f"rel_{n}": e for n, e in r.get("rel_err", {}).items()}) for r in report["attention"]]
    cp = report["model"][0]["cp_schedule"] if report["model"] else 1
    return {"attention": dict(title=f"causal attention, {report['heads']} heads x {report['head_dim']}, batch 1, "
                                    "bf16, one GPU", columns=ATTENTION_COLUMNS, rows=att,
                              notes=["rel. err: the largest |ring - SDPA| over the largest |SDPA| (SDPA's own bf16 "
                                     "rounding is of the same order)"]),
            "model": dict(title=f"`1b` model, one sequence per step, the ring schedule (cp{cp}) as its attention "
                                "core, 16 bytes/param", columns=MODEL_COLUMNS, rows=report["model"],
                          notes=["fixed: weights, gradients and AdamW states before a step; what benchmarks/"
                                 "cp_memory.py fits bytes per token to"])}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--lengths", type=ints, default=[32768, 65536, 131072])
    ap.add_argument("--cps", type=ints, default=[2, 4])
    ap.add_argument("--layouts", default="zigzag")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-lengths", type=ints, default=[8192, 16384])
    ap.add_argument("--policies", default="none,selective,full")
    ap.add_argument("--model-cp", type=int, default=2)
    ap.add_argument("--out", default="ring_attention.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("ring_attention.py measures a GPU; the CPU check is tests/test_ring_blocks.py")
    report = dict(device=torch.cuda.get_device_name(), gpu_memory_gib=torch.cuda.get_device_properties(0)
                  .total_memory / 2**30, torch=torch.__version__, python=platform.python_version(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command=" ".join(sys.argv), heads=HEADS, head_dim=HEAD_DIM)
    report["attention"] = attention_rows(a.lengths, a.cps, a.layouts.split(","), a.reps)
    report["model"] = model_rows(a.model_lengths, [p for p in a.policies.split(",") if p], a.model_cp)
    report["meta"] = {k: report[k] for k in ("device", "torch", "date", "command")}
    report["tables"] = tables(report)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
