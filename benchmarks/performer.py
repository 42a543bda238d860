"""Performer (FAVOR+, causal) vs SDPA (flash on GPU) attention: time and peak memory of forward + backward against
sequence length, batch x length fixed (--tokens) so the largest lengths fit. Heads and head dim of the 350m preset
(16 x 64), bf16 inputs; performer with the default M = d ln d features, fp32 inside, at each --chunks size.

    python benchmarks/performer.py [--lengths 2048,...,65536] [--tokens 65536] [--chunks 256,1024] [--out F]

Peak memory is measured above the inputs (q, k, v and their gradients are allocated before the reset).
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
import torch.nn.functional as F

from lowbit.models.performer import Performer, default_features
from tables import write  # benchmarks/tables.py: the result file in bench's layout

HEADS, HEAD_DIM = 16, 64


def measure(fn, q, k, v, reps: int, device: str) -> tuple[float, float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(reps + 2):
        for t in (q, k, v):
            t.grad = None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        sync()
        t0 = time.perf_counter()
        fn(q, k, v).backward(torch.ones(q.shape, device=q.device, dtype=q.dtype))
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return statistics.median(times) * 1e3, peak


def flash(q, k, v):
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="2048,4096,8192,16384,32768,65536")
    p.add_argument("--tokens", type=int, default=65536, help="batch x length")
    p.add_argument("--chunks", default="256,1024")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", type=int, default=0, help="also print the top GPU kernels of performer at this L")
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    header = {"device": dev, "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python"] + sys.argv), "heads": HEADS, "head_dim": HEAD_DIM,
              "features": default_features(HEAD_DIM), "tokens": a.tokens, "dtype": str(dtype)}
    backends = {"sdpa": flash}
    for c in map(int, a.chunks.split(",")):
        backends[f"performer c{c}"] = Performer(HEAD_DIM, default_features(HEAD_DIM), c).to(a.device)
    rows = []
    for n in map(int, a.lengths.split(",")):
        b = max(1, a.tokens // n)
        g = torch.Generator(device=a.device).manual_seed(0)
        q, k, v = (torch.randn(b, HEADS, n, HEAD_DIM, device=a.device, generator=g).to(dtype).requires_grad_()
                   for _ in range(3))
        row = {"length": n, "batch": b}
        for name, fn in backends.items():
            try:
                row[name] = dict(zip(("ms", "peak_mib"), measure(fn, q, k, v, a.reps, a.device)))
            except torch.OutOfMemoryError:
                row[name] = {"error": "out of memory"}
            gc.collect()
            if a.device == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.profile and a.device == "cuda":  # where performer's time goes, for BENCHMARKS.md
        n, fn = a.profile, list(backends.values())[-1]
        q, k, v = (torch.randn(max(1, a.tokens // n), HEADS, n, HEAD_DIM, device="cuda", dtype=dtype)
                   .requires_grad_() for _ in range(3))
        measure(fn, q, k, v, 1, a.device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn(q, k, v).backward(torch.ones_like(q))
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    names = list(backends)
    print(f"\n{dev} | torch {torch.__version__} | {header['date']} | `{header['command']}`\n")
    print("| L | batch | " + " | ".join(f"{x} ms (MiB)" for x in names) + " | performer / sdpa time (best chunk) |")
    print("|---|---|" + "---|" * len(names) + "---|")
    for r in rows:
        cells = [f"{r[x]['ms']:.2f} ({r[x]['peak_mib']:.0f})" if "ms" in r[x] else r[x]["error"] for x in names]
        perf = [r[x]["ms"] for x in names[1:] if "ms" in r[x]]
        ratio = f"{min(perf) / r['sdpa']['ms']:.2f}" if perf and "ms" in r["sdpa"] else ""
        print(f"| {r['length']} | {r['batch']} | " + " | ".join(cells) + f" | {ratio} |")
    write(a.out, header, rows, "performer", performer_columns(names), [performer_row(r, names) for r in rows])


def performer_columns(names: list[str]) -> list[tuple[str, str]]:
    return ([("length", "L"), ("batch", "batch")] + [(x, f"{x} ms (MiB)".replace("sdpa", "sdpa (flash)"))
                                                     for x in names] + [("ratio", "performer / flash")])


def performer_row(r: dict, names: list[str]) -> dict:
    """One line of BENCHMARKS.md's table (benchmarks/tables.py): ms (peak MiB), the best chunk's time over flash's."""
    out = {"length": f"{r['length']:,}", "batch": str(r["batch"])}
    for x in names:
        out[x] = f"{r[x]['ms']:.2f} ({r[x]['peak_mib']:.0f})" if "ms" in r[x] else r[x]["error"]
    perf = [r[x]["ms"] for x in names[1:] if "ms" in r[x]]
    out["ratio"] = f"{min(perf) / r['sdpa']['ms']:.2f}" if perf and "ms" in r["sdpa"] else ""
    return out


if __name__ == "__main__":
    main()
