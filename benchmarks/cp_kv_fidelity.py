"""What FP8 K/V on the context-parallel ring (parallel.cp_kv_dtype fp8) cost in accuracy: SNR (dB) of the attention
output and of dQ, dK, dV against exact attention, on the CPU.

Under fp8 every rank attends to K/V quantized shard by shard (kv_wire.KVWire: E4M3, one power-of-two scale per
sequence and head of a shard), its gradients passed straight through the cast; tests/test_context_parallel.py
checks that the ring computes exactly that. So this measures causal attention over the whole sequence with K/V
quantized per zigzag shard against the same attention with exact K/V, both in fp64 (only the cast differs), for
cp = 2 and 8, beside K/V rounded to bf16 for reference. Two sources of q, k, v:

    random  standard normal, the `1b` preset's heads (32 query heads over 4 K/V heads, head dim 64)
    tiny    the `tiny` preset's attention inputs (after RoPE) in every layer, at initialization, on random tokens

    python benchmarks/cp_kv_fidelity.py [--seq 1024] [--out benchmarks/results/cp_kv_fidelity_cpu.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.distributed.context_parallel import shard_positions
from lowbit.distributed.kv_wire import KVWire
from lowbit.models.llama import Llama, resolve_model_args
from lowbit.train.config import ModelConfig


def snr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    return 10 * torch.log10(ref.double().pow(2).sum() / (ref.double() - got.double()).pow(2).sum()).item()


def per_shard(t: torch.Tensor, cp: int, cast) -> torch.Tensor:
    """t [B, H, L, D] with each zigzag shard of cp cast as its rank sends it."""
    out = t.clone()
    for r in range(cp):
        pos = shard_positions(t.shape[2], cp, r)
        out[:, :, pos] = cast(t[:, :, pos])
    return out


def attention_grads(q, k, v, dout):
    """(out, dq, dk, dv) of causal GQA attention in fp64 (K/V repeated to q's heads as the model does)."""
    q, k, v = (t.double().detach().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def compare(q, k, v, cp: int, kv: str) -> dict:
    """SNRs of attention with K/V cast per shard (`kv`: fp8, bf16) against exact K/V."""
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    wire = KVWire("fp8")
    cast = wire.local if kv == "fp8" else (lambda t: t.bfloat16().to(t.dtype))
    ref = attention_grads(q, k, v, dout)
    got = attention_grads(q, per_shard(k, cp, cast), per_shard(v, cp, cast), dout)
    names = ("out", "dq", "dk", "dv")
    return {f"{n}_snr_db": round(snr_db(a, b), 2) for n, a, b in zip(names, ref, got)}


def random_qkv(seq: int, batch: int = 2, heads: int = 32, kv_heads: int = 4, dim: int = 64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(batch, h, seq, dim, generator=g) for h in (heads, kv_heads, kv_heads)]


class _Capture(nn.Module):
    """An attention core that records its inputs and runs the one it replaced."""

    def __init__(self, core, seen: list):
        super().__init__()
        self.core, self.seen = core, seen

    def forward(self, q, k, v, positions=None):
        self.seen.append((q.detach(), k.detach(), v.detach()))
        return self.core(q, k, v, positions)


def tiny_qkv(seq: int, batch: int = 2) -> list[tuple]:
    """The tiny model's (q, k, v) of every layer, K/V repeated to the query heads before the core (divided back
    out here: every group of repeated heads is one K/V head)."""
    torch.manual_seed(0)
    args = resolve_model_args(ModelConfig(preset="tiny"), vocab_size=256, seq_len=seq)
    model = Llama(args)
    seen: list = []
    for m in model.modules():
        if hasattr(m, "core") and hasattr(m, "wq"):
            m.core = _Capture(m.core, seen)
    with torch.no_grad():
        model(torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(2)))
    rep = args.n_heads // args.n_kv_heads
    return [(q, k[:, ::rep], v[:, ::rep]) for q, k, v in seen]


def rows(seq: int) -> list[dict]:
    out = []
    sources = {"random": [random_qkv(seq)], "tiny": tiny_qkv(seq)}
    for source, layers in sources.items():
        # bf16 rounds each element alone: the split does not matter; fp8's scales are per shard
        for cp, kv in ((2, "fp8"), (8, "fp8"), (2, "bf16")):
            per_layer = [compare(*qkv, cp, kv) for qkv in layers]
            # the layers' worst SNR for each quantity (one layer for random)
            worst = {key: min(r[key] for r in per_layer) for key in per_layer[0]}
            out.append({"source": source, "layers": len(layers), "cp": cp if kv == "fp8" else None, "kv": kv,
                        **worst})
            print(json.dumps(out[-1]), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/cp_kv_fidelity_cpu.json")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    args = argv if argv is not None else sys.argv[1:]
    result = {"device": "cpu", "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "command": " ".join(["python benchmarks/cp_kv_fidelity.py", *args]),
              "seq": a.seq, "rows": rows(a.seq)}
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
