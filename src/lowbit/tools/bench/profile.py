"""Where a training step's time goes (`lowbit bench step --profile`): the step's phases timed apart (forward with
the loss; backward with the gradient hooks; clipping, optimizer step and zero_grad), and, on a GPU, one profiled
step's kernel time by kind with the time no kernel ran (the host-bound part: launches, guards, Python)."""

from __future__ import annotations

import re
import statistics
import time

import torch

# Kernel kinds, matched in this order against CUDA kernel names (cuBLAS/cuBLASLt: nvjet, sm90_xmma, cutlass, gemm;
# inductor's GEMM templates: triton_tem; flash/cuDNN/efficient attention; inductor's fused pointwise and reductions:
# triton_poi, triton_red, triton_per; the rest are eager aten kernels: copies, casts, foreach, reductions).
KINDS = (("gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|scaled_mm|triton_tem|splitk", re.I)),
         ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)),
         ("fused", re.compile(r"^triton_")),
         ("aten", re.compile(r"")))
PHASES = ("forward", "backward", "optimizer")


def kind(kernel_name: str) -> str:
    return next(k for k, rx in KINDS if rx.search(kernel_name))


def phase_ms(forward, backward, optimizer, device: torch.device, iters: int) -> dict:
    """Median ms of each phase over `iters` steps: CUDA events between the phases on a GPU (they run in stream
    order, so each interval is that phase's GPU time plus any wait for its launches); wall clock on the CPU."""
    times = {p: [] for p in PHASES}
    for _ in range(iters):
        if device.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            marks[0].record()
            loss = forward()
            marks[1].record()
            backward(loss)
            marks[2].record()
            optimizer()
            marks[3].record()
            torch.cuda.synchronize(device)
            spans = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
        else:
            t = [time.perf_counter()]
            loss = forward()
            t.append(time.perf_counter())
            backward(loss)
            t.append(time.perf_counter())
            optimizer()
            t.append(time.perf_counter())
            spans = [(b - a) * 1e3 for a, b in zip(t, t[1:])]
        for p, s in zip(PHASES, spans):
            times[p].append(s)
    return {f"{p}_ms": statistics.median(v) for p, v in times.items()}


def kernel_ms(step, device: torch.device) -> dict:
    """One profiled step on a GPU: kernel ms by kind, their sum, the step's span and the part of it no kernel
    covered (`idle_ms`: the GPU waited for the host). Empty on the CPU (no kernels to tell apart)."""
    if device.type != "cuda":
        return {}
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
             if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    out = {f"{k}_ms": 0.0 for k, _ in KINDS}
    for start, end, name in spans:
        out[f"{kind(name)}_ms"] += (end - start) / 1e3
    out["kernels"] = len(spans)
    out["kernel_ms"] = sum(out[f"{k}_ms"] for k, _ in KINDS)
    if spans:
        out["span_ms"] = (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)) / 1e3
        out["idle_ms"] = out["span_ms"] - covered([(s, e) for s, e, _ in spans]) / 1e3
    return out


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
    return out
