"""Fidelity of numerics.fp8_attention against exact (fp64) causal attention, on the CPU: SNR (dB) of the scores
(QKᵀ, the logits of the softmax), the output, and the gradients dQ, dK, dV, beside bf16 attention (Q, K, V and the
upstream gradient rounded to bf16, fp32 math: what SDPA's bf16 kernels compute, to their accumulation order).

    python benchmarks/attention_fidelity.py [--seq 512] [--head-dim 64] [--heads 4] [--seeds 0,1]
                                            [--out benchmarks/results/attention_fidelity_cpu.json]

Inputs: `gaussian` (Q, K, V ~ N(0, 1)); `outlier channels` (4 of the head dimensions of Q and K, 8 of V, 20x
larger: the massive-activation channels of trained LLMs); `heads 32x apart` (head h of Q, K, V times 32^-h);
`sharp` (Q 4x larger: near one-hot softmax rows). Rows `fp8 per-tensor` (one power-of-two scale for the whole of
Q, K and V each, forward only) show what the per-head scales buy; `out_worst_head_snr_db` is the output's SNR in
its worst (sequence, head), where one scale for all heads would show.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from pathlib import Path

import torch

from lowbit.numerics.attention import emulate, math_backward, quantize_heads
from lowbit.numerics.qtensor import quantize
from lowbit.numerics.scaling import Scaling

ROOT = Path(__file__).resolve().parent.parent


def snr_db(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.double(), x.double()
    return round(10 * math.log10(ref.pow(2).sum().item() / max((x - ref).pow(2).sum().item(), 1e-300)), 2)


def inputs(case: str, shape, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    if case == "outlier channels":
        for t, n in ((q, 4), (k, 4), (v, 8)):
            t[..., torch.randperm(shape[-1], generator=g)[:n]] *= 20
    elif case == "heads 32x apart":
        for t in (q, k, v):
            t *= 32.0 ** -torch.arange(shape[1], dtype=torch.float32)[:, None, None]
    elif case == "sharp":
        q *= 4
    return [q, k, v]


def exact(q, k, v, dout, scale):
    """fp64 attention and its gradients: the reference."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return (q @ k.transpose(-1, -2)).detach(), out.detach(), torch.autograd.grad(out, (q, k, v), dout.double())


def bf16(q, k, v, dout, scale):
    q, k, v = (t.bfloat16().float().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    grads = torch.autograd.grad(out, (q, k, v), dout.bfloat16().float())
    return (q @ k.transpose(-1, -2)).detach(), out.bfloat16().detach(), grads


def fp8(q, k, v, dout, scale):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out, _ = torch.ops.lowbit.fp8_attention(q, k, v, scale)
    (q8, qs), (k8, ks) = quantize_heads(q), quantize_heads(k)
    scores = (q8.float() * qs[..., None, None]) @ (k8.float() * ks[..., None, None]).transpose(-1, -2)
    return scores, out.detach(), torch.autograd.grad(out, (q, k, v), dout)


def fp8_per_tensor(q, k, v, dout, scale):
    """The same kernel numerics with one power-of-two scale per tensor (forward only)."""
    B, H = q.shape[:2]
    ops = []
    for t in (q, k, v):
        qt = quantize(t.reshape(B * H, -1), Scaling("e4m3", "tensor", pow2=True))
        ops += [qt.data.view(t.shape), qt.scale_inv.expand(B, H).float()]
    q8, qs, k8, ks, v8, vs = ops
    out, _ = emulate(q8, k8, v8, qs, ks, vs, scale)
    scores = (q8.float() * qs[..., None, None]) @ (k8.float() * ks[..., None, None]).transpose(-1, -2)
    return scores, out, None


def row(case: str, name: str, got, ref) -> dict:
    L = ref[0].shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    r = {"case": case, "attention": name, "scores_snr_db": snr_db(ref[0][..., causal], got[0][..., causal]),
         "out_snr_db": snr_db(ref[1], got[1]),
         "out_worst_head_snr_db": min(snr_db(ref[1][b, h], got[1][b, h]) for b in range(ref[1].shape[0])
                                      for h in range(ref[1].shape[1]))}
    if got[2] is not None:
        r.update({f"d{n}_snr_db": snr_db(b, a) for n, a, b in zip("qkv", got[2], ref[2])})
    return r


CASES = ("gaussian", "outlier channels", "heads 32x apart", "sharp")
METHODS = {"bf16": bf16, "fp8 per-head": fp8, "fp8 per-tensor": fp8_per_tensor}


def measure(shape, seeds) -> list[dict]:
    """Each (case, attention) row, its SNRs averaged over the seeds (in dB)."""
    scale = 1 / math.sqrt(shape[-1])
    rows = []
    for case in CASES:
        per_seed = {name: [] for name in METHODS}
        for seed in seeds:
            q, k, v = inputs(case, shape, seed)
            dout = torch.randn(shape, generator=torch.Generator().manual_seed(1000 + seed))
            ref = exact(q, k, v, dout, scale)
            for name, fn in METHODS.items():
                per_seed[name].append(row(case, name, fn(q, k, v, dout, scale), ref))
        for name, rs in per_seed.items():
            keys = [key for key in rs[0] if key.endswith("_db")]
            rows.append({**rs[0], **{key: round(sum(r[key] for r in rs) / len(rs), 2) for key in keys}})
    return rows


def math_backward_check(shape) -> float:
    """SNR of the CPU backward (math_backward at exact out / lse) against fp64 autograd: the formula's own error."""
    q, k, v = inputs("gaussian", shape, 0)
    dout = torch.randn(shape)
    s = 1 / math.sqrt(shape[-1])
    _, out, grads = exact(q, k, v, dout, s)
    L = shape[2]
    lse = (q.double() @ k.double().transpose(-1, -2) * s).masked_fill(
        torch.ones(L, L, dtype=torch.bool).triu(1), -math.inf).logsumexp(-1)
    return min(snr_db(b, a) for a, b in zip(math_backward(dout, q, k, v, out.float(), lse.float(), s), grads))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention_fidelity_cpu.json"))
    a = p.parse_args(argv)
    shape = (1, a.heads, a.seq, a.head_dim)
    rows = measure(shape, [int(s) for s in a.seeds.split(",")])
    result = {"what": "SNR (dB) against fp64 causal attention, mean over seeds", "shape_bhld": list(shape),
              "seeds": a.seeds, "rows": rows, "math_backward_snr_db": math_backward_check(shape),
              "meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "torch": torch.__version__, "python": sys.version.split()[0], "host": platform.machine()}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    for r in rows:
        print(" | ".join(f"{v}" for v in r.values()))
    print(f"math backward (fp32 formula at exact out/lse) vs fp64: {result['math_backward_snr_db']} dB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
