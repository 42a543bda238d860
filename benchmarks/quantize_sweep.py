"""Launch settings of lowbit's Triton quantization kernels (lowbit/numerics/kernels.py) on a GPU, each timed in a CUDA graph
(the kernels' own time, no host launches) on 16384 x 4096 bf16 tensors, beside inductor's compiled quantize and a
plain copy (the bandwidth a pass can reach). The calls cycle through 4 inputs (no call finds its input in L2 from
the call before, as in training). Every quantize setting's bytes and scale are checked against the compiled
quantize; the amax settings are timed only.

    PYTHONPATH=src python3 benchmarks/quantize_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from lowbit.numerics import kernels
from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling
from lowbit.tools.bench.common import graph_ms

DEFAULTS = {k: getattr(kernels, k) for k in ("AMAX_BLOCK", "AMAX_PER_SM", "AMAX_WARPS", "CAST_BLOCK", "CAST_WARPS",
                                             "REVERSE")}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--out", default="")
    a = p.parse_args()
    dev = torch.device("cuda")
    xs = [torch.randn(a.tokens, a.dim, device=dev).to(torch.bfloat16) for _ in range(4)]
    x, turn = xs[0], itertools.cycle(xs)
    spec = Scaling("e4m3")
    mb = x.numel() * 3 / 1e6  # read 2 bytes, write 1 per element
    rows = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [a.tokens, a.dim],
            "timing": "CUDA graph of 20 calls, replayed 10 times"}

    def row(name, ms, nbytes_mb=mb, **extra):  # printed, and the JSON rewritten: a run cut short keeps its rows
        rows.append({"variant": name, "ms": ms, "gb_s": nbytes_mb / ms, **extra})
        print(f"{name:<60} {ms:8.4f} ms {nbytes_mb / ms:7.0f} GB/s {extra or ''}", flush=True)
        if a.out:
            json.dump({"meta": meta, "rows": rows}, open(a.out, "w"), indent=1)

    compiled = torch.compile(lambda t: (lambda q: (q.data, q.scale_inv))(quantize(t, spec)))
    ref, ref_inv = compiled(x)
    row("inductor: compiled quantize", graph_ms(lambda: compiled(next(turn)), dev))
    y = torch.empty_like(x)
    row("copy bf16 -> bf16 (4 bytes per element)", graph_ms(lambda: y.copy_(next(turn)), dev), x.numel() * 4 / 1e6)
    scale = torch.ones((), device=dev)
    row("cast alone, given scale (one pass, 3 bytes)",
        graph_ms(lambda: kernels.cast(next(turn), scale, 448.0, torch.float8_e4m3fn), dev))
    row("amax alone (2 bytes)", graph_ms(lambda: kernels.amax(next(turn)), dev), x.numel() * 2 / 1e6)

    def use(**kw):  # these launch settings, the defaults for the rest
        for k, v in {**DEFAULTS, **kw}.items():
            setattr(kernels, k, v)

    def setting(**kw):
        use(**kw)
        data, inv = kernels.quantize(x, 448.0, torch.float8_e4m3fn)
        same = torch.equal(data.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(inv, ref_inv)
        return graph_ms(lambda: kernels.quantize(next(turn), 448.0, torch.float8_e4m3fn), dev), same

    # the amax pass alone first, then the cast's settings with the best amax
    best_amax, best = {}, None
    for block, per_sm, warps in itertools.product((2048, 4096, 8192), (2, 4, 8, 16), (4, 8, 16)):
        kw = {"AMAX_BLOCK": block, "AMAX_PER_SM": per_sm, "AMAX_WARPS": warps}
        use(**kw)
        ms = graph_ms(lambda: kernels.amax(next(turn)), dev)
        row(f"amax {block}, {per_sm} programs per SM, {warps} warps", ms, x.numel() * 2 / 1e6, **kw)
        if best is None or ms < best:
            best, best_amax = ms, kw
    for block, warps, reverse in itertools.product((2048, 4096, 8192), (4, 8), (False, True)):
        kw = {**best_amax, "CAST_BLOCK": block, "CAST_WARPS": warps, "REVERSE": reverse}
        ms, same = setting(**kw)
        row(f"quantize: cast {block}, {warps} warps, {'reverse' if reverse else 'forward'}", ms, same=same, **kw)
    ms, same = setting()
    row(f"quantize: defaults {DEFAULTS}", ms, same=same, **DEFAULTS)


if __name__ == "__main__":
    main()
