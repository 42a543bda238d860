"""`lowbit bench optim`: the optimizer step alone, per recipe, on a preset's parameters (or one weight of
--shape): LowbitAdamW as the trainer builds it, gradients present (stored in the recipe's gradient format),
median ms of `step()`. GB/s counts the bytes the update must read (weights or master, gradient, both moments)
and write (moments, weights, master) at the recipe's storage: the floor of any implementation, so GB/s over the
HBM bandwidth is how close the update runs to it. The bf16 row is fp32 AdamW (torch's fused kernel), every
recipe's optimizer for the weights it does not cover, and torchao's too."""

from __future__ import annotations

import contextlib
import time

import torch

from lowbit.optim import update_kernel
from lowbit.optim.precision import KINDS, STORED, StatePrecision
from lowbit.tools.bench import profile
from lowbit.tools.bench.common import GPU_HBM_BYTES_PER_S, Report, Table, device_name, error_row, release, \
    time_ms, variants


def update_bytes(prec: StatePrecision) -> int:
    """Bytes per parameter the update must move: read the weights (or the master), gradient and moments; write
    the moments, the weights and the master."""
    size = {k: 0 if v == "none" else KINDS[v][0].itemsize for k, v in prec.__dict__.items() if k in STORED}
    read = size["grads"] + size["exp_avg"] + size["exp_avg_sq"] + (size["master"] or size["weights"])
    return read + size["exp_avg"] + size["exp_avg_sq"] + size["weights"] + size["master"]


class OneWeight(torch.nn.Module):
    """A single linear weight of shape (out, in): --shape's model."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.w = torch.nn.Linear(in_features, out_features, bias=False)


def _build(a, v, device):
    from lowbit.tools.bench.step import build

    return build(a.model_args, v, device, OneWeight(*a.shape).to(device) if a.shape else None)


def fill_grads(opt) -> None:
    """A gradient for every parameter, delivered as the trainer's backward would: into its store or p.grad."""
    g = torch.Generator(device=opt.param_groups[0]["params"][0].device).manual_seed(0)
    for group in opt.param_groups:
        for p in group["params"]:
            grad = torch.randn(p.shape, device=p.device, generator=g, dtype=torch.float32).mul_(1e-3).to(p.dtype)
            store = opt._grads.get(p)
            if store is not None:
                store.add(grad)
            else:
                p.grad = grad


def _paths(vs, update: str):
    """(variant, update path) pairs: the bf16 row (fused fp32 AdamW) once, each lowbit recipe per path asked for;
    path None keeps LOWBIT_TRITON_UPDATE's choice."""
    names = {"default": [None], "compiled": ["compiled"], "triton": ["Triton"], "both": ["compiled", "Triton"]}
    for v in vs:
        for path in [None] if v.impl == "bf16" else names[update]:
            yield v, path


def _passes(device: torch.device) -> dict:
    """The share of tensor updates that ran the weights' amax pass (update_kernel.COUNTS), where the Triton update
    certified scales."""
    counts = update_kernel.COUNTS.get(torch.device(device.type, torch.cuda.current_device())) \
        if device.type == "cuda" else None
    return {"w_amax_pct": 100 * counts[0].item() / counts[1].item()} if counts is not None and counts[1] else {}


PASSES = {"_amax_kernel": "pass_one_ms", "_weights_amax_kernel": "weights_pass_ms", "_write_kernel": "writes_ms"}


def _profile(step, device: torch.device, ms: float) -> dict:
    """One profiled step's kernel time: each Triton pass (update_kernel's kernels by name), the other kernels
    (fp32 AdamW, the scales' and counters' copies), kernel launches, and idle: the timed step less the union of
    kernel intervals (launch gaps, each kernel's ramp and last wave, the host)."""
    k = profile.kernel_ms(step, device, top=12)
    if not k:
        return {}
    out = {v: 0.0 for v in PASSES.values()}
    for entry in k["top"]:
        key = PASSES.get(entry["kernel"])
        if key:
            out[key] += entry["ms"]
    busy = sum(k[f"{n}_ms"] for n in profile.KIND_NAMES)
    out.update(other_kernels_ms=busy - sum(out.values()), launches=k["kernels"], busy_ms=k["busy_ms"],
               idle_ms=profile.idle(ms, k["busy_ms"]), top=k["top"])
    return out


def run_optim(a, device: torch.device, report: Report) -> None:
    what = f"one {a.shape[0]}x{a.shape[1]} weight" if a.shape else f"`{a.preset}`'s parameters"
    mode = {True: "compiled", False: "eager", None: "compiled on a GPU and for large CPU tensors"}[a.compile]
    t = report.table(Table("optim", f"optimizer step, {what} ({mode})",
                           [("variant", "variant", ""), ("params_m", "params (M)", ",.1f"),
                            ("covered_pct", "covered %", ".1f"), ("bytes_per_param", "bytes/param moved", ".2f"),
                            ("ms", "ms/step (median)", ".2f"), ("gb_per_s", "GB/s", ",.1f"),
                            ("hbm_pct", "% of HBM", ".1f"), ("vs_fp32_adamw", "ms vs fp32 AdamW", ".2f"),
                            ("w_amax_pct", "weights' amax passes %", ".1f"), ("first_step_s", "first step s", ".1f")]
                           + ([("pass_one_ms", "pass one ms", ".2f"), ("weights_pass_ms", "weights' pass ms", ".2f"),
                               ("writes_ms", "writes ms", ".2f"), ("other_kernels_ms", "other kernels ms", ".2f"),
                               ("launches", "kernels", ","), ("idle_ms", "no kernel running ms", ".2f")]
                              if a.profile else [])))
    hbm = next((bw for k, bw in GPU_HBM_BYTES_PER_S.items() if k in device_name(device)), None) \
        if device.type == "cuda" else None
    for v, path in _paths(variants(a.recipe_list, []), a.update):
        row = {"variant": v.name + (f" ({path})" if path and a.update == "both" else "")}
        model = opt = None
        try:
            model, opt = _build(a, v, device)
            if a.compile is not None:
                opt._compile = a.compile
            fill_grads(opt)
            moved = covered = total = 0
            for group in opt.param_groups:
                n = sum(p.numel() for p in group["params"])
                moved += n * update_bytes(opt.precision_of(group))
                total += n
                covered += n if group.get("covered") else 0
            with update_kernel.forced(path == "Triton") if path else contextlib.nullcontext():
                t0 = time.perf_counter()
                opt.step()
                row["first_step_s"] = time.perf_counter() - t0
                update_kernel.reset_counts()
                row.update(time_ms(opt.step, device, a.steps, a.warmup))
                row.update(_passes(device))
                if a.profile:  # a profiler failure loses the profile, not the timing
                    try:
                        row.update(_profile(opt.step, device, row["ms"]))
                    except Exception as e:
                        row["profile_error"] = f"{type(e).__name__}: {e}"
            row.update(params_m=total / 1e6, covered_pct=100 * covered / total, bytes_per_param=moved / total,
                       gb_per_s=moved / (row["ms"] / 1e3) / 1e9)
            if hbm:
                row["hbm_pct"] = 100 * moved / (row["ms"] / 1e3) / hbm
        except Exception as e:
            row.update(error_row(e))
        finally:
            model = opt = None
            release(device)
        report.row(t, row)
    base = next((r for r in t.rows if r["variant"] == "bf16" and "ms" in r), None)
    for r in t.rows:
        if base and "ms" in r:
            r["vs_fp32_adamw"] = r["ms"] / base["ms"]
    t.notes.append("bf16: the bf16 recipe's optimizer, fp32 AdamW in torch's fused kernel (also every recipe's "
                   "for the parameters it does not cover, and torchao's). bytes/param moved: what the update must "
                   "read and write at the recipe's storage, averaged over covered and fp32 parameters"
                   + (f"; % of HBM against {hbm / 1e12:.1f} TB/s" if hbm else "")
                   + ". The lowbit update reads its inputs twice (amaxes, then the writes; the Triton kernels' "
                   "first pass skips the weights where their scale is certified), once with "
                   "optim.scales=bound, and with optim.scales=mixed the FP8 gradient and first moment twice "
                   "(their amax pass), the rest once; (compiled): its passes by torch.compile, (Triton): "
                   "src/lowbit/optim/update_kernel.py's kernels. weights' amax passes: under amax scales, the share of "
                   "tensor updates whose weights' scale bounds did not fix (their amax pass ran; fill_grads' "
                   "gradients, the same every step).")
    report.save(complete=False)
