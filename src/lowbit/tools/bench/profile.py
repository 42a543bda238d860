"""Where a training step's time goes (`lowbit bench step --profile`): the step's phases timed apart (forward with
the loss; backward with the gradient hooks; clipping, optimizer step and zero_grad), and, on a GPU, one profiled
step's kernel time by kind, and the part of the timed step in which no kernel ran (host-bound: launches, guards,
Python)."""

from __future__ import annotations

import re
import statistics
import time

import torch

# Kernel kinds, matched in this order against CUDA kernel names: attention first (FlashAttention's names carry
# cutlass types), then inductor's fused pointwise/reduction kernels (triton_poi/red/per: quantization, norms, RoPE,
# the compiled optimizer; their names may mention the ops they fuse, e.g. _scaled_mm), then GEMMs (cuBLAS/cuBLASLt:
# nvjet, sm90_xmma, cutlass, gemm; inductor's GEMM templates: triton_tem); the rest are eager aten kernels (copies,
# casts, foreach, reductions, selections) and memcpy/memset.
KINDS = (("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
         ("fused", re.compile(r"^triton_(poi|red|per)")),
         ("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|scaled_mm|triton_tem|splitk", re.I)),
         ("aten", re.compile(r"")))
PHASES = ("forward", "backward", "optimizer")


def kind(kernel_name: str) -> str:
    return next(k for k, rx in KINDS if rx.search(kernel_name))


def phase_ms(forward, backward, optimizer, device: torch.device, iters: int) -> dict:
    """Median ms of each phase over `iters` steps: CUDA events between the phases on a GPU (they run in stream
    order, so each interval is that phase's GPU time plus any wait for its launches); wall clock on the CPU.
    Also the host's own time to issue each phase (`host_<phase>_ms`) and its wait for the GPU at the step's end
    (`host_wait_ms`): a phase whose host time reaches its GPU time, with little wait left, is host-bound (or
    syncs)."""
    cuda = device.type == "cuda"

    def mark():
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    times = {p: [] for p in (*PHASES, *(f"host_{p}" for p in PHASES), "host_wait")}
    marks, host = [], []

    def tick():
        marks.append(mark())
        host.append(time.perf_counter())

    for _ in range(iters):
        marks.clear()
        host.clear()
        tick()
        loss = forward()
        tick()
        backward(loss)
        tick()
        optimizer()
        tick()
        if cuda:
            torch.cuda.synchronize(device)
        times["host_wait"].append((time.perf_counter() - host[-1]) * 1e3)
        for p, a, b, ha, hb in zip(PHASES, marks, marks[1:], host, host[1:]):
            times[p].append(a.elapsed_time(b) if cuda else (b - a) * 1e3)
            times[f"host_{p}"].append((hb - ha) * 1e3)
    return {f"{p}_ms": statistics.median(v) for p, v in times.items()}


def kernel_ms(step, device: torch.device, top: int = 40) -> dict:
    """One profiled step on a GPU: kernel ms by kind, `busy_ms` (the union of kernel intervals: streams may
    overlap) and the `top` kernels by total time. Empty on the CPU (no kernels to tell apart). The profiler slows
    the host, so the profiled step's own span overstates the GPU's idle time: `idle(step_ms, ...)` uses the timed
    step instead."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    # CUDA-side events that are not kernels: user annotations (e.g. torch.optim's "Optimizer.step#..." range) span
    # other kernels and would be counted twice
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
             and e.time_range.end > e.time_range.start]
    out = {f"{k}_ms": 0.0 for k, _ in KINDS}
    by_name: dict[str, list] = {}
    for start, end, name in spans:
        out[f"{kind(name)}_ms"] += (end - start) / 1e3
        entry = by_name.setdefault(name, [0.0, 0])
        entry[0] += (end - start) / 1e3
        entry[1] += 1
    out["kernels"] = len(spans)
    out["busy_ms"] = covered([(s, e) for s, e, _ in spans]) / 1e3
    out["top"] = [{"kernel": n[:120], "kind": kind(n), "ms": ms, "calls": calls}
                  for n, (ms, calls) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    return out


def idle(step_ms: float, busy_ms: float) -> float:
    """Time of a step in which no kernel ran (the GPU waited for the host: launches, guards, Python)."""
    return max(0.0, step_ms - busy_ms)


def covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels on several streams may overlap)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def columns(device: torch.device) -> list[tuple[str, str, str]]:
    out = [("variant", "variant", ""), ("step_ms", "step ms", ".1f")] + [(f"{p}_ms", f"{p} ms", ".1f") for p in PHASES]
    if device.type == "cuda":
        out += [(f"{k}_ms", f"{k} kernels ms", ".1f") for k, _ in KINDS]
        out += [("idle_ms", "GPU idle ms", ".1f"), ("kernels", "kernels", "d")]
        out += [(f"host_{p}_ms", f"{p} host ms", ".1f") for p in PHASES] + [("host_wait_ms", "host waits ms", ".1f")]
    return out
