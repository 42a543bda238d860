"""Host cost of the fused FP8 producers (numerics.fused_producers) per call, beside the GPU time they save.

    python benchmarks/producer_launch.py [--tokens 16384] [--dim 2048] [--hidden 5632] [--calls 50]
                                         [--out producer_launch.json]

For RMSNorm [tokens, dim] and SwiGLU [tokens, hidden] in bf16 (the `1b` step's shapes by default), each way of
producing the FP8 operand: the unfused torch path (the norm or product, then lowbit's amax and cast kernels), the
ops called eagerly (`torch.ops.lowbit.*`, triton_ops), the launch functions they wrap (no op dispatch), and the
same producer compiled (torch.compile of a function calling it, as the compiled blocks do: inductor launches the
ops' kernels from its own code). `host_us`: the CPU's time to issue one call while a sleep kernel keeps the GPU
busy; `gpu_us`: the GPU time of the same calls, run back to back behind that sleep. A producer whose host_us
exceeds its gpu_us leaves the GPU idle unless other work is queued ahead of it: what the fused step's GPU idle
time is made of. A second table times the transposing casts (`*_cast_t`) per tile shape.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch
import torch.nn.functional as F

from lowbit.numerics import kernels, producers
from lowbit.numerics.scaling import Scaling, scale_from_amax

S = Scaling("e4m3")


def timed(fn, calls: int) -> dict:
    """host_us: the time to issue one call while the GPU is held busy by a sleep (so the host never waits for
    it); gpu_us: the calls' GPU time, queued behind that sleep and so run back to back without idle gaps."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of GPU clock cycles: longer than issuing the calls
    start.record()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    return dict(host_us=round(1e6 * host / calls, 1), gpu_us=round(1e3 * start.elapsed_time(end) / calls, 1))


def unfused_norm(x, w):
    h = (w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype))
    return kernels.quantize(h, 448.0, torch.float8_e4m3fn)


def unfused_swiglu(a, b):
    return kernels.quantize(F.silu(a) * b, 448.0, torch.float8_e4m3fn)


def launch_norm(x, w):
    amax = producers._rmsnorm_launch(x, w, 1e-5, None, False, False)[2]
    return producers._rmsnorm_launch(x, w, 1e-5, scale_from_amax(amax, S)[0], False, True)


def launch_swiglu(a, b):
    amax = producers._swiglu_launch(a, b, None, False, False, True)[1]
    return producers._swiglu_launch(a, b, scale_from_amax(amax, S)[0], False, True, False)


def rows(tokens: int, dim: int, hidden: int, calls: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.ones(dim, device="cuda", dtype=torch.float32)
    a, b = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    ways = {
        "rmsnorm: unfused (torch norm, amax + cast kernels)": lambda: unfused_norm(x, w),
        "rmsnorm: ops, eager": lambda: producers.rmsnorm_fp8(x, w, 1e-5, S),
        "rmsnorm: launch functions, no op dispatch": lambda: launch_norm(x, w),
        "rmsnorm: ops, compiled caller": torch.compile(lambda: producers.rmsnorm_fp8(x, w, 1e-5, S)),
        "swiglu: unfused (torch product, amax + cast kernels)": lambda: unfused_swiglu(a, b),
        "swiglu: ops, eager": lambda: producers.swiglu_fp8(a, b, S),
        "swiglu: launch functions, no op dispatch": lambda: launch_swiglu(a, b),
        "swiglu: ops, compiled caller": torch.compile(lambda: producers.swiglu_fp8(a, b, S)),
    }
    out = []
    for name, fn in ways.items():
        out.append(dict(variant=name, **timed(fn, calls)))
        print(json.dumps(out[-1]), flush=True)
    return out


COLUMNS = [["variant", "producer, way", ""], ["host_us", "host µs per call", ".1f"],
           ["gpu_us", "GPU µs per call", ".1f"]]

# the transposing casts' tiles tried: (rows, columns, warps) (producers.py's: 32 x 128, 4 warps)
TILES = ((128, 128, 8), (64, 128, 4), (128, 64, 4), (64, 64, 4), (128, 128, 4), (64, 128, 8), (32, 128, 4),
         (16, 128, 4))


def tile_rows(tokens: int, dim: int, hidden: int, calls: int) -> list[dict]:
    """The transposing casts alone (swiglu_cast_t, rmsnorm_cast_t: FP8 row-major and transposed in one pass) per
    tile shape, GPU time and the bandwidth of the bytes they must move (bf16 inputs read, two FP8 copies written);
    beside them delayed scaling's one-pass SwiGLU cast, which also measures the amax (swiglu_cast_t with_amax), and
    once the amax passes that current scaling runs first (and the norm under either scaling)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.ones(dim, device="cuda", dtype=torch.float32)
    a, b = (torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    scale = torch.ones((), device="cuda")
    rstd = torch.ones(tokens, 1, device="cuda")
    kept = producers.T_BLOCK_M, producers.T_BLOCK_N, producers.T_WARPS
    out = []

    def row(variant, fn, moved):
        us = timed(fn, calls)["gpu_us"]
        out.append(dict(variant=variant, gpu_us=us, gb_per_s=round(moved / us / 1e3, 1)))
        print(json.dumps(out[-1]), flush=True)

    ops = torch.ops.lowbit
    row("swiglu_amax (current scaling's first pass)", lambda: ops.swiglu_amax(a, b), 4 * a.numel())
    row("rmsnorm_amax (current scaling's first pass)", lambda: ops.rmsnorm_amax(x, w, 1e-5), 2 * x.numel())
    try:
        for bm, bn, warps in TILES:
            producers.T_BLOCK_M, producers.T_BLOCK_N, producers.T_WARPS = bm, bn, warps
            for name, fn, moved in (
                    ("swiglu_cast_t", lambda: ops.swiglu_cast_t(a, b, scale, False), 6 * a.numel()),
                    ("swiglu_cast_t with its amax (delayed)", lambda: ops.swiglu_cast_t(a, b, scale, False, True),
                     6 * a.numel()),
                    ("rmsnorm_cast_t", lambda: ops.rmsnorm_cast_t(x, w, rstd, scale, False), 4 * x.numel())):
                row(f"{name}, {bm} x {bn} tile, {warps} warps", fn, moved)
    finally:
        producers.T_BLOCK_M, producers.T_BLOCK_N, producers.T_WARPS = kept
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=5632)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="producer_launch.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("producer_launch.py measures a GPU's launches")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    table = dict(title=f"FP8 producers, {a.tokens} tokens (norm dim {a.dim}, SwiGLU hidden {a.hidden}), bf16",
                 columns=COLUMNS, rows=rows(a.tokens, a.dim, a.hidden, a.calls))
    tiles = dict(title=f"the transposing casts per tile, {a.tokens} tokens (norm dim {a.dim}, SwiGLU hidden "
                       f"{a.hidden}), bf16 to E4M3", rows=tile_rows(a.tokens, a.dim, a.hidden, a.calls),
                 columns=[["variant", "kernel, tile", ""], ["gpu_us", "GPU µs per call", ".1f"],
                          ["gb_per_s", "GB/s of the bytes moved", ",.1f"]])
    with open(a.out, "w") as f:
        json.dump(dict(meta=meta, what="launch", tables={"launch": table, "tiles": tiles}), f, indent=1)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
