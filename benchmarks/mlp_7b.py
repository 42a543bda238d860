"""LLaMA-7B MLP block (SwiGLU, dim 4096, hidden 11008), 16384 tokens, forward + backward under torch.compile:
bf16 vs lowbit fp8-tensorwise / fp8-rowwise vs torchao float8 tensorwise / rowwise, in one process on one GPU.
Also: per-tensor FP8 quantization of a 16384 x 4096 bf16 tensor (lowbit vs the plain formula compiled).

    python benchmarks/mlp_7b.py [--out results.json]
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.numerics.qtensor import quantize
from lowbit.numerics.recipes import convert, get_recipe
from lowbit.numerics.scaling import Scaling

DIM, HIDDEN, TOKENS = 4096, 11008, 16384


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def bench(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def variants(base: MLP):
    yield "bf16", base
    for name in ("fp8-tensorwise", "fp8-rowwise"):
        m = copy.deepcopy(base)
        convert(m, get_recipe(name))
        yield f"lowbit {name}", m
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as e:
        print(f"torchao not available ({e}); skipping it", flush=True)
        return
    for recipe in ("tensorwise", "rowwise"):
        m = copy.deepcopy(base)
        convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name(recipe))
        yield f"torchao {recipe}", m


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args()
    torch.manual_seed(0)
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python3"] + sys.argv)}
    try:
        import torchao

        header["torchao"] = torchao.__version__
    except ImportError:
        pass
    base = MLP().cuda().to(torch.bfloat16)
    x = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(TOKENS, DIM, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, module in variants(base):
        compiled = torch.compile(module)

        def step():
            compiled(x).backward(dy)

        try:
            ms = bench(step, a.iters)
            rows.append({"name": name, "ms": ms})
        except Exception as e:  # a failure is a result too: report it and go on
            rows.append({"name": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(json.dumps(rows[-1]), flush=True)
        torch._dynamo.reset()
    bf16 = rows[0]["ms"]
    for r in rows:
        if "ms" in r:
            r["speedup_vs_bf16"] = bf16 / r["ms"]

    # per-tensor quantization of 16384 x 4096 bf16
    t = torch.randn(16384, 4096, device="cuda", dtype=torch.bfloat16)
    spec = Scaling("e4m3")
    lowbit_q = torch.compile(lambda v: quantize(v, spec).data)

    def plain(v):
        scale = 448.0 / v.abs().amax().float().clamp(min=1e-12)
        return (v.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reciprocal()

    plain_q = torch.compile(plain)
    floor_ms = t.numel() * 3 / 3.35e12 * 1e3  # read 2 bytes + write 1 byte per element at H100 HBM3 3.35 TB/s
    quant = {"lowbit_quantize_ms": bench(lambda: lowbit_q(t), 50), "plain_compiled_ms": bench(lambda: plain_q(t), 50),
             "memory_floor_ms_h100": floor_ms}
    print(json.dumps(quant), flush=True)

    print(f"\n{header['device']} | torch {header['torch']} | torchao {header.get('torchao', '-')} | {header['date']} | "
          f"`{header['command']}`\n")
    print("| LLaMA-7B MLP fwd+bwd, 16384 tokens, compiled | ms (median) | speed-up vs bf16 |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['ms']:.2f} | {r['speedup_vs_bf16']:.2f}x |" if "ms" in r else
              f"| {r['name']} | {r['error']} | |")
    print(f"\nper-tensor quantization 16384x4096 bf16 -> e4m3: lowbit {quant['lowbit_quantize_ms']:.3f} ms, plain "
          f"formula compiled {quant['plain_compiled_ms']:.3f} ms, memory floor {floor_ms:.3f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"header": header, "mlp": rows, "quantize": quant}, f, indent=1)


if __name__ == "__main__":
    main()
