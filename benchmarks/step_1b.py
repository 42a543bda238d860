"""BF16 training step of the `1b` preset (TinyLlama-1.1B shape), batch 8 x seq 2048, torch.compile, fused AdamW:
lowbit's Llama beside HF transformers' LlamaForCausalLM of the same shape, in one process on one GPU.

    python benchmarks/step_1b.py [--steps 10] [--out results.json]

Prints a markdown table (with device, torch version, date, command) and writes JSON.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from lowbit.models.llama import Llama, resolve_model_args
from lowbit.tools.export_hf import hf_config
from lowbit.train.config import ModelConfig
from lowbit.train.metrics import gpu_peak_flops
from tables import write  # benchmarks/tables.py: the result file in bench's layout

BATCH, SEQ, VOCAB = 8, 2048, 32000


def build_lowbit(checkpointing: str):
    args = resolve_model_args(ModelConfig(preset="1b", checkpointing=checkpointing), vocab_size=VOCAB, seq_len=SEQ)
    model = Llama(args).cuda()
    return model, lambda m, x, y: m(x, y), model.flops_per_token(SEQ)


def build_hf(checkpointing: str):
    import transformers

    args = resolve_model_args(ModelConfig(preset="1b"), vocab_size=VOCAB, seq_len=SEQ)
    with torch.device("meta"):
        flops = Llama(args).flops_per_token(SEQ)  # same shape, same count
    cfg = {k: v for k, v in hf_config(args, 0).items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, attn_implementation="sdpa")).cuda()
    if checkpointing == "full":
        model.gradient_checkpointing_enable()

    def loss_fn(m, x, y):
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))

    return model, loss_fn, flops


def time_steps(model, loss_fn, steps: int, warmup: int = 3) -> tuple[list[float], float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    compiled = torch.compile(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda", generator=g)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(compiled, inp, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, torch.cuda.max_memory_allocated() / 2**30


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--configs", default="lowbit:none,lowbit:selective,hf:none")
    a = p.parse_args()
    dev = torch.cuda.get_device_name()
    peak = gpu_peak_flops(torch.device("cuda"))
    header = {"device": dev, "torch": torch.__version__, "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join([sys.executable.split("/")[-1]] + sys.argv), "batch": BATCH, "seq": SEQ,
              "peak_bf16_flops": peak}
    rows = []
    for item in a.configs.split(","):
        impl, ckpt = item.split(":")
        torch.manual_seed(0)
        gc.collect()
        torch.cuda.empty_cache()
        try:
            model, loss_fn, flops = (build_lowbit if impl == "lowbit" else build_hf)(ckpt)
            times, mem = time_steps(model, loss_fn, a.steps)
        except torch.OutOfMemoryError:
            rows.append({"impl": impl, "checkpointing": ckpt, "error": "out of memory"})
            print(f"{impl} {ckpt}: out of memory", flush=True)
            model = None
            continue
        finally:
            model = None
            torch._dynamo.reset()
        ms = statistics.median(times) * 1e3
        tps = BATCH * SEQ / (ms / 1e3)
        row = {"impl": impl, "checkpointing": ckpt, "ms_per_step": ms, "ms_min": min(times) * 1e3,
               "tokens_per_s": tps, "mfu": tps * flops / peak if peak else None, "peak_mem_gib": mem,
               "flops_per_token": flops}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{dev} | torch {torch.__version__} | {header['date']} | `{header['command']}`\n")
    print("| model | act. checkpointing | ms/step (median) | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | {r['checkpointing']} | {r['error']} | | | |")
        else:
            mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a"
            print(f"| {r['impl']} | {r['checkpointing']} | {r['ms_per_step']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} "
                  f"| {r['peak_mem_gib']:.1f} |")
    write(a.out, header, rows, "hf", HF_COLUMNS, [hf_row(r) for r in rows])


HF_COLUMNS = [("model", "model"), ("checkpointing", "activation checkpointing"), ("ms", "ms/step (median)"),
              ("tokens_per_s", "tokens/s"), ("mfu", "MFU"), ("peak", "peak memory GiB")]


def hf_row(r: dict) -> dict:
    """One line of BENCHMARKS.md's table (benchmarks/tables.py)."""
    if r["impl"] == "lowbit":
        model = "lowbit `Llama`"
    else:
        try:
            from importlib.metadata import version

            model = f"HF transformers `LlamaForCausalLM` ({version('transformers')}, sdpa)"
        except ImportError:
            model = "HF transformers `LlamaForCausalLM` (sdpa)"
    if "error" in r:
        return {"model": model, "checkpointing": r["checkpointing"], "ms": r["error"]}
    return {"model": model, "checkpointing": r["checkpointing"], "ms": f"{r['ms_per_step']:.1f}",
            "tokens_per_s": f"{r['tokens_per_s']:,.0f}", "mfu": f"{100 * r['mfu']:.1f}%" if r["mfu"] else "n/a",
            "peak": f"{r['peak_mem_gib']:.1f}"}


if __name__ == "__main__":
    main()
