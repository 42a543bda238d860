"""`lowbit bench step --max-batch N`: per recipe, the largest micro-batch (up to N sequences of --seq tokens) whose
training step fits in the GPU's memory, and the step's speed there: what a recipe's memory savings buy. One
model and optimizer per variant; batch sizes doubled until a step runs out of memory, then bisected; each tried
size runs one whole step (forward, backward, clipping, update), so the optimizer's states and the compiled
graphs' workspaces count. On a GPU, once two sizes have fit, the next size tried is the one their peak memory
predicts (linear in the batch), then its neighbours. Activation checkpointing is a variant like any other setting:
`fp8lm-o2+model.checkpointing=full`."""

from __future__ import annotations

import gc
import time

import torch

from lowbit.numerics.scaling_state import reports_held
from lowbit.tools.bench.common import Report, Table, error_row, release, sync, time_ms, variants
from lowbit.tools.bench.step import autocast, batch, build
from lowbit.train.compile import compile_model


def _step_fn(fwd, opt, device):
    def step(x, y):
        with autocast(device):
            loss = fwd(x, y)
        with reports_held():
            loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def largest_batch(fits, cap: int, predict=None) -> int:
    """The largest b in 1..cap with fits(b) (0 if none), fits being monotone. Without `predict`: doubling, then
    bisection. `predict()`: the size the memory measured so far says is the largest that fits (None while it
    cannot tell), tried next, so that a 7b step costs about four tries, not eight; after two predicted sizes
    that did not fit, bisection (a prediction far too high would otherwise step down one size a try)."""
    ok, oom = 0, cap + 1  # the largest size known to fit, the smallest known not to
    misses = 0
    while oom - ok > 1:
        guess = predict() if predict is not None and misses < 2 else None
        if guess is not None:
            b = min(max(guess, ok + 1), oom - 1)
        else:
            b = min(ok * 2, cap) if oom > cap and ok else max(1, (ok + oom) // 2) if oom <= cap else 1
        if fits(b):
            ok = b
        else:
            oom = b
            misses += guess is not None
    return ok


def _linear_guess(peaks: dict[int, float], limit: float):
    """From the peak bytes of the two largest sizes that fit, the largest size whose peak stays under `limit`
    (memory grows linearly with the batch); None with fewer than two."""
    if len(peaks) < 2:
        return None
    (b0, p0), (b1, p1) = sorted(peaks.items())[-2:]
    per = (p1 - p0) / (b1 - b0)
    return max(1, int((limit - p1) // per) + b1) if per > 0 else None


def run_capacity(a, device: torch.device, report: Report) -> None:
    mode = f"compiled ({a.compile_scope})" if a.compile else "eager"
    t = report.table(Table("capacity", f"largest micro-batch per recipe, `{a.preset}`, seq {a.seq}, {mode}",
                           [("variant", "variant", ""), ("max_batch", "max batch", "d"),
                            ("ms", "ms/step (median)", ".1f"), ("tokens_per_s", "tokens/s", ",.0f"),
                            ("tokens_vs_bf16", "tokens/s vs bf16 at its max", ".3f"),
                            ("peak_mem_gib", "peak GiB", ".2f"), ("tried", "batches tried", "")]))
    for v in variants(a.recipe_list, a.torchao_list):
        row = {"variant": v.name}
        model = opt = fwd = None
        try:
            model, opt = build(a.model_args, v, device)
            fwd = compile_model(model, a.compile_scope) if a.compile else model
            step = _step_fn(fwd, opt, device)
            tried, seconds, peaks = [], [], {}

            def fits(b: int) -> bool:
                t0 = time.perf_counter()
                x, y = batch(b, a.seq, a.vocab, device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                try:
                    step(x, y)
                    sync(device)
                    ok = True
                    if device.type == "cuda":
                        peaks[b] = torch.cuda.max_memory_allocated(device)
                except torch.OutOfMemoryError:
                    ok = False
                opt.zero_grad(set_to_none=True)
                del x, y
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                tried.append(f"{b}{'' if ok else ' (oom)'}")
                seconds.append(round(time.perf_counter() - t0, 1))  # where a capacity search's time goes
                print(f"  {v.name}: batch {b} {'fits' if ok else 'out of memory'} ({seconds[-1]} s)", flush=True)
                return ok

            # 97% of the GPU: the caching allocator's fragmentation and the CUDA context take the rest
            limit = 0.97 * torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
            best = largest_batch(fits, a.max_batch, (lambda: _linear_guess(peaks, limit)) if limit else None)
            row["tried"] = ", ".join(tried)
            row["tried_s"] = seconds
            if not best:
                row["error"] = "out of memory at batch 1"
            else:
                x, y = batch(best, a.seq, a.vocab, device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                row.update(time_ms(lambda: step(x, y), device, a.steps, a.warmup), max_batch=best)
                row["tokens_per_s"] = best * a.seq / (row["ms"] / 1e3)
                if device.type == "cuda":
                    row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        except Exception as e:
            row.update(error_row(e))
        finally:
            model = opt = fwd = None
            release(device)
        report.row(t, row)
    base = next((r for r in t.rows if r["variant"] == "bf16" and r.get("tokens_per_s")), None)
    for r in t.rows:
        if base and r.get("tokens_per_s"):
            r["tokens_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
    t.notes.append("Each batch size tried runs one whole step; a step that raises out-of-memory counts as not "
                   "fitting. tokens/s vs bf16: at each row's own largest batch against bf16's at its largest.")
    report.save(complete=False)
