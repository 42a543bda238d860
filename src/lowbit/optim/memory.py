"""Bytes per parameter by category, measured from the tensors that exist, beside the theoretical figure."""

from __future__ import annotations

import torch

from lowbit.optim.adamw import LowbitAdamW, local

CATEGORIES = ("weights", "master", "grads", "exp_avg", "exp_avg_sq")


def _nbytes(t: torch.Tensor | None) -> int:
    """What this process holds (its shard, under FSDP2)."""
    return 0 if t is None else local(t).numel() * t.element_size()


def memory_report(optimizer: LowbitAdamW) -> dict:
    """{"covered": ..., "model": ...}: for the parameters the recipe covers (groups marked `covered`) and for all
    of them, measured bytes/param per category (per-tensor scales counted apart, in `scales`), their total, and
    the theoretical total from the groups' precisions. Gradients count where they exist: call it after backward."""
    scopes = {"covered": [g for g in optimizer.param_groups if g["covered"]], "model": optimizer.param_groups}
    report = {}
    for scope, groups in scopes.items():
        measured = dict.fromkeys(CATEGORIES + ("scales",), 0)
        theory, n = 0.0, 0
        for group in groups:
            bpp = optimizer.precision_of(group).bytes_per_param()
            for p in group["params"]:
                st = optimizer.state.get(p, {})  # none: ZeRO-1 keeps it on another replica
                store = optimizer._grads.get(p)
                measured["weights"] += _nbytes(p)
                measured["grads"] += _nbytes(store.data) if store is not None else _nbytes(p.grad)
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    measured[name] += _nbytes(st.get(name))
                measured["scales"] += sum(_nbytes(v) for k, v in st.items() if k.endswith("_scale"))
                measured["scales"] += _nbytes(store.scale) if store is not None else 0
                n += p.numel()
                theory += bpp["total"] * p.numel()
        per = {k: v / max(n, 1) for k, v in measured.items()}
        per["total"] = sum(per[k] for k in CATEGORIES)
        per["total_with_scales"] = per["total"] + per["scales"]
        report[scope] = {"params": n, "bytes_per_param": per, "theoretical_bytes_per_param": theory / max(n, 1),
                         "bytes": sum(measured.values())}
    return report


def format_report(report: dict) -> str:
    lines = []
    for scope, r in report.items():
        b = r["bytes_per_param"]
        cats = ", ".join(f"{k} {b[k]:.2f}" for k in CATEGORIES)
        lines.append(f"lowbit: memory ({scope}, {r['params'] / 1e6:.2f}M params): {b['total']:.2f} bytes/param "
                     f"[{cats}; scales {b['scales']:.4f}] (theory {r['theoretical_bytes_per_param']:.2f})")
    return "\n".join(lines)
