"""Where a training step's time goes (`lowbit bench step --profile`): the step's phases timed apart (forward with
the loss; backward with the gradient hooks; clipping, optimizer step and zero_grad), and, on a GPU, one profiled
step's kernel time by kind, and the part of the timed step in which no kernel ran (host-bound: launches, guards,
Python)."""

from __future__ import annotations

import re
import statistics
import time

import torch

from lowbit.tools.bench.common import Table

# Kernel kinds. GEMMs (cuBLAS/cuBLASLt: nvjet, sm90_xmma, cutlass, gemm; inductor's GEMM templates: triton_tem)
# and attention (FlashAttention's and cuDNN's names carry cutlass types and "flash": attention is matched first) by
# name. Inductor's fused kernels (triton_poi/red/per_fused_<ops>_N) are told apart by the aten ops their name lists:
# quantization ops only (amax, abs, clamp, reciprocal, the casts and transposes feeding _scaled_mm) is `quant`;
# quantization fused into a producer or consumer that bf16 runs too (silu·mul, a norm, RoPE, the loss) is
# `fused_quant`, whose bf16 counterpart counts as `fused`; the rest is `fused`. lowbit's own Triton kernels by their
# names (QUANT_KERNELS, FUSED_QUANT_KERNELS). Eager aten kernels that touch an FP8 type or take an amax (abs, max
# reductions) are `quant`; the rest (copies, foreach, the fused AdamW, embedding, memcpy/memset) `aten`.
KIND_NAMES = ("gemm", "attention", "quant", "fused_quant", "fused", "aten")
ATTENTION = re.compile(r"flash|fmha|attention|sdpa|cudnn", re.I)  # cuDNN runs only SDPA in a LLaMA step
GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|triton_tem|splitk", re.I)
INDUCTOR = re.compile(r"^triton_(?:poi|red|per)_fused_(.*?)(?:_\d+)?$")
QUANT_OPS = {"amax", "abs", "clamp", "reciprocal", "scaled"}  # words of the op names (_scaled_mm: "scaled")
COMPUTE_OPS = {"silu", "mean", "rsqrt", "pow", "sum", "add", "sub", "cat", "neg", "softmax", "nll", "embedding", "exp",
               "log", "sigmoid", "gelu", "relu", "tanh", "sqrt", "sin", "cos", "cumsum"}
QUANT_KERNELS = re.compile(r"^_(amax|cast|cast_transpose)_kernel$")
FUSED_QUANT_KERNELS = re.compile(r"^_(rmsnorm|swiglu)_fp8\w*_kernel$")
ATEN_QUANT = re.compile(r"float8|e4m3|e5m2|abs_kernel|MaxOps", re.I)
LABELS = {"gemm": "GEMM", "attention": "attention", "quant": "quantization", "fused_quant": "fused with quantization",
          "fused": "other fused", "aten": "other kernels", "idle": "GPU idle"}
PHASES = ("forward", "backward", "optimizer")


def kind(kernel_name: str) -> str:
    """The kind (KIND_NAMES) of a CUDA kernel, from its name."""
    if ATTENTION.search(kernel_name):
        return "attention"
    m = INDUCTOR.match(kernel_name)
    if m:
        words = set(m.group(1).split("_"))
        if words & QUANT_OPS:
            return "fused_quant" if words & COMPUTE_OPS else "quant"
        return "fused"
    if QUANT_KERNELS.match(kernel_name):
        return "quant"
    if FUSED_QUANT_KERNELS.match(kernel_name):
        return "fused_quant"
    if GEMM.search(kernel_name):
        return "gemm"
    return "quant" if ATEN_QUANT.search(kernel_name) else "aten"


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
    out = {f"{k}_ms": 0.0 for k in KIND_NAMES}
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
        out += [(f"{k}_ms", f"{LABELS[k]} ms", ".1f") for k in KIND_NAMES]
        out += [("idle_ms", "GPU idle ms", ".1f"), ("kernels", "kernels", "d")]
        out += [(f"host_{p}_ms", f"{p} host ms", ".1f") for p in PHASES] + [("host_wait_ms", "host waits ms", ".1f")]
    return out


def elementwise_ms(row: dict) -> float | None:
    """quant + fused_quant + fused ms of a profile row (None for a row without them)."""
    parts = [row.get(f"{k}_ms") for k in ("quant", "fused_quant", "fused")]
    return None if any(p is None for p in parts) else sum(parts)


def kinds_table(rows: list[dict], title: str = "kernel time by kind, ms per step", base: str = "bf16") -> Table:
    """The profile's kernel time by kind with a column per variant (`rows`: the profile table's rows; errors
    left out), each cell after `base`'s also giving its difference to `base`'s. `bench step --profile` adds it to
    its report as the table `profile_kinds`, so benchmarks/report.py renders it as any other."""
    rows = [r for r in rows if "error" not in r]
    ref = next((r for r in rows if r.get("variant") == base), None)
    names = [str(r["variant"]) for r in rows]
    t = Table("profile_kinds", title, [("kind", "ms per step", "")] + [(n, n, "") for n in names])
    # the elementwise kernels together: against bf16's, what quantization costs wherever inductor put it
    keys = [(f"{k}_ms", LABELS[k]) for k in (*KIND_NAMES, "idle")] + [("elementwise", "quantization + fused, all"),
                                                                      ("step_ms", "step (timed)")]
    for key, label in keys:
        out = {"kind": label}
        for n, r in zip(names, rows):
            v = elementwise_ms(r) if key == "elementwise" else r.get(key)
            cell = "" if v is None else f"{v:.1f}"
            base_v = None if ref is None else elementwise_ms(ref) if key == "elementwise" else ref.get(key)
            if v is not None and r is not ref and base_v is not None:
                cell += f" ({v - base_v:+.1f})"
            out[n] = cell
        t.rows.append(out)
    t.notes.append("Quantization: kernels doing only amax, cast, scale or FP8 transposes; fused with quantization: "
                   "those fused into a norm, SwiGLU, RoPE or a gradient sum that bf16 runs too (bf16 counts those "
                   "as other fused), so the row 'quantization + fused, all' against bf16's is what quantization "
                   f"costs. In parentheses: the difference to {base}.")
    return t


def side_by_side(rows: list[dict], base: str = "bf16") -> str:
    """kinds_table as Markdown."""
    return kinds_table(rows, base=base).markdown()


if __name__ == "__main__":  # python -m lowbit.tools.bench.profile X.json: the side-by-side table of a report
    import json
    import sys

    for path in sys.argv[1:]:
        print(side_by_side(json.load(open(path))["tables"]["profile"]["rows"]) + "\n")
