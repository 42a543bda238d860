"""OCC fidelity on heavy-tailed token activations (Student-t, 3 degrees of freedom), FP4 (E2M1, per-token absmax
scaling): cosine similarity, MSE and SNR of the activation as the FP4 GEMM sees it, and of the GEMM output against
fp64, for no clamping, clamping at the 0.999 quantile without compensation, and 0.999 / 0.99 / 0.97 with the
sparse compensation. Also the cost of the quantile (exact kthvalue, strided sample, torch.quantile).

    python benchmarks/occ_fidelity.py [--tokens 2048] [--dim 1024] [--device cpu] [--out results.json]

With --device cuda the quantile cost is timed on the GPU beside the layer's FP4 cast of the same activation (the
fidelity table is computed on CPU either way).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch

from lowbit.numerics.fp4 import OCC, abs_quantile, occ_residual, occ_split
from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling

FP4_ROW = Scaling("e2m1", "row")
CASES = [("no clamp", None, False), ("clamp 0.999", 0.999, False), ("clamp 0.999 + comp", 0.999, True),
         ("clamp 0.99 + comp", 0.99, True), ("clamp 0.97 + comp", 0.97, True)]


def metrics(ref: torch.Tensor, got: torch.Tensor) -> dict:
    ref, got = ref.double().flatten(), got.double().flatten()
    noise = (ref - got).pow(2)
    return {"cos": torch.nn.functional.cosine_similarity(ref, got, dim=0).item(), "mse": noise.mean().item(),
            "snr_db": 10 * torch.log10(ref.pow(2).sum() / noise.sum()).item()}


def table(x: torch.Tensor, w: torch.Tensor) -> list[dict]:
    y_ref = x.double() @ w.double().t()
    qw = quantize(w, FP4_ROW).dequantize()
    rows = []
    for name, alpha, comp in CASES:
        if alpha is None:
            clamped, residual = x, None
        else:
            clamped, idx, val = occ_split(x, OCC(alpha, "exact"))
            residual = occ_residual(idx, val, x.shape)
        xq = quantize(clamped, FP4_ROW).dequantize()
        seen = xq + residual.to_dense() if comp else xq  # the activation the layer effectively multiplies
        y = xq @ qw.t() + (torch.sparse.mm(residual, w.t()) if comp else 0)
        rows.append({"case": name, "nonzero_residual_pct": 100 * residual._nnz() / x.numel() if residual is not None
                     else 0.0, "activation": metrics(x, seen), "output": metrics(y_ref, y)})
    return rows


def student_t(tokens: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, dim, generator=g)
    chi2 = torch.randn(tokens, dim, 3, generator=g).pow(2).sum(-1)  # 3 degrees of freedom
    return z / (chi2 / 3).sqrt()


def quantile_cost(x: torch.Tensor, alpha: float = 0.99, reps: int = 5) -> dict:
    out = {}
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    exact = abs_quantile(x, alpha, "exact")
    for name, fn in [("kthvalue (exact)", lambda: abs_quantile(x, alpha, "exact")),
                     ("token sample", lambda: abs_quantile(x, alpha, "sample")),
                     ("torch.quantile (sort)", lambda: torch.quantile(x.abs().flatten()[: 1 << 24], alpha)),
                     ("for scale: FP4 row cast of x", lambda: quantize(x, FP4_ROW).data.float().sum())]:
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            v = fn()
        sync()
        out[name] = {"ms": (time.perf_counter() - t0) / reps * 1e3,
                     "rel_error": abs(v.item() - exact.item()) / exact.item() if "cast" not in name else None}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    header = {"torch": torch.__version__, "python": platform.python_version(), "device": dev,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python"] + sys.argv)}
    x = student_t(a.tokens, a.dim)
    w = torch.randn(a.dim, a.dim, generator=torch.Generator().manual_seed(1)) * 0.02
    rows = table(x, w)
    cost = quantile_cost(x.to(a.device))
    print(f"{header['date']} | torch {torch.__version__} | {dev} | `{header['command']}`\n")
    print("| case | residual non-zeros | activation cos / MSE / SNR dB | GEMM output cos / MSE / SNR dB |")
    print("|---|---|---|---|")
    for r in rows:
        act, out = r["activation"], r["output"]
        print(f"| {r['case']} | {r['nonzero_residual_pct']:.2f}% | {act['cos']:.5f} / {act['mse']:.4f} / "
              f"{act['snr_db']:.2f} | {out['cos']:.5f} / {out['mse']:.3e} / {out['snr_db']:.2f} |")
    print(f"\n| quantile of {x.numel():,} values (alpha 0.99) | ms | relative error |\n|---|---|---|")
    for name, c in cost.items():
        err = "" if c["rel_error"] is None else f"{c['rel_error']:.2e}"
        print(f"| {name} | {c['ms']:.2f} | {err} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"header": header, "rows": rows, "quantile_cost": cost}, f, indent=1)


if __name__ == "__main__":
    main()
