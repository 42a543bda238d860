"""The two-GPU harness of multi_gpu.sh: run `lowbit train` with measurement hooks, then summarise runs into tables.

    python multi_gpu_report.py train [--section.key=value ...]   (under torchrun, or alone for one process)
        `lowbit train`, plus: GradSync.sync, pipeline.run and sync_partial_grads timed (device synchronised
        around each call); BENCH_NO_CKPT=1 skips the end-of-run checkpoint;
        BENCH_BUBBLE=1 times each pipeline stage's forward+backward over the same micro-batches alone, after
        training (no P2P, no waiting): the pure per-stage compute. Each rank writes RUN_DIR/bench_rank{r}.json.
    python multi_gpu_report.py collect NAME RUN_DIR RC LOG       one JSON line: losses, step times, bytes, timings
    python multi_gpu_report.py report RESULTS.jsonl...           a markdown table of every run
    python multi_gpu_report.py compare RESULTS.jsonl...          losses against the one-GPU runs; pipeline bubble
    python multi_gpu_report.py cp RESULTS.jsonl...               part f: context parallel layouts, longest sequence
    python multi_gpu_report.py tables --out TABLES.json RAW...   BENCHMARKS.md's two-GPU tables (multi_gpu_tables.py)

Nothing here changes what lowbit computes: the hooks only add device synchronisation and timers.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

TIMES: dict[str, list[float]] = {}
CAPTURE: dict = {}


def _sync():
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(name, fn):
    def wrapper(*a, **k):
        _sync()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        _sync()
        TIMES.setdefault(name, []).append(time.perf_counter() - t0)
        return out
    return wrapper


def _stage_compute(module, inputs, n_micro: int, reps: int = 3) -> list[float]:
    """Seconds of forward+backward of this stage over n_micro micro-batches, alone (no P2P, no waiting)."""
    import torch
    from lowbit.distributed import pipeline

    x_shape, x_dtype, y = inputs
    dev = next(module.parameters()).device

    def once():
        for _ in range(n_micro):
            if module.first:
                x = torch.randint(0, 1000, x_shape, device=dev)
            else:
                x = torch.randn(x_shape, device=dev, dtype=x_dtype, requires_grad=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                out = module(x)
                if module.last:
                    loss = pipeline.loss_fn(out, y.to(dev))
            if module.last:
                loss.backward()
            else:
                out.backward(torch.randn_like(out))
        module.zero_grad(set_to_none=True)

    times = []
    for i in range(reps + 1):
        _sync()
        t0 = time.perf_counter()
        once()
        _sync()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    return times


def train(argv: list[str]) -> int:
    import torch
    import lowbit.train.checkpoint as ckpt
    import lowbit.train.step as step
    from lowbit.cli import main
    from lowbit.distributed import grad_sync, pipeline

    grad_sync.GradSync.sync = _timed("grad_sync", grad_sync.GradSync.sync)
    step.sync_partial_grads = _timed("sp_partial_grads", step.sync_partial_grads)
    run_orig = pipeline.run

    def run(schedule, module, x, y, train=True):
        if not train:
            return run_orig(schedule, module, x, y, train=False)
        return _timed("pipeline_run", run_orig)(schedule, module, x, y, train=True)
    pipeline.run = run
    build_orig = pipeline.build_schedule

    def build_schedule(module, stage, pp, device, group, n_micro, kind):
        if "module" not in CAPTURE:  # the first is the training schedule
            CAPTURE.update(module=module, n_micro=n_micro)
            fwd = module.forward

            def forward(x):
                if "inputs" not in CAPTURE:
                    CAPTURE["inputs"] = (tuple(x.shape), x.dtype)
                return fwd(x)
            module.forward = forward
        return build_orig(module, stage, pp, device, group, n_micro, kind)
    pipeline.build_schedule = build_schedule
    if os.environ.get("BENCH_NO_CKPT") == "1":
        for name in ("begin", "write_tensors", "commit"):  # the trainer's save_checkpoint calls these three
            setattr(ckpt, name, lambda *a, **k: None)
    # the run directory comes from the arguments
    run_dir = next((a.split("=", 1)[1] for a in argv if a.startswith("--run.dir=")), None)
    rc, error = 0, None
    t0 = time.perf_counter()
    try:
        rc = main(["train", *argv])
    except torch.OutOfMemoryError as e:
        rc, error = 3, "OOM: " + str(e).splitlines()[0][:300]
    wall = time.perf_counter() - t0
    rank = int(os.environ.get("RANK", "0"))
    out = {"rank": rank, "rc": rc, "error": error, "wall_s": wall,
           "times": TIMES}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["device"] = torch.cuda.get_device_name()
    out["torch"] = torch.__version__
    if error is None and os.environ.get("BENCH_BUBBLE") == "1" and "module" in CAPTURE:
        m = CAPTURE["module"]
        shape, dtype = CAPTURE["inputs"]
        y = torch.randint(0, 1000, shape[:2])
        out["stage"] = {"first": m.first, "last": m.last, "blocks": [m.blocks.start, m.blocks.stop],
                        "n_micro": CAPTURE["n_micro"], "micro_shape": list(shape),
                        "compute_s": _stage_compute(m, (shape, dtype, y), CAPTURE["n_micro"])}
    if run_dir:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run_dir) / f"bench_rank{rank}.json").write_text(json.dumps(out))
    if error:
        print(f"bench: rank {rank}: {error}", file=sys.stderr, flush=True)
    return rc


def _median(xs):
    return statistics.median(xs) if xs else None


def collect(name: str, run_dir: str, rc: str, log: str) -> dict:
    d = Path(run_dir)
    steps, val, rec = [], None, {"name": name, "rc": int(rc)}
    cfg = (d / "config.toml").read_text() if (d / "config.toml").exists() else ""
    tokens_per_step = None
    for line in cfg.splitlines():
        if line.startswith("batch_size"):
            bs = int(line.split("=")[1])
        if line.startswith("seq_len"):
            sl = int(line.split("=")[1])
    if cfg:
        tokens_per_step = bs * sl
    if (d / "metrics.jsonl").exists():
        for line in (d / "metrics.jsonl").read_text().splitlines():
            r = json.loads(line)
            if "loss" in r:
                steps.append(r)
            if "val_loss" in r:
                val = r["val_loss"]
    rec["steps_done"] = len(steps)
    rec["loss"] = [r["loss"] for r in steps]
    rec["val_loss"] = val
    timed = [r for r in steps if r["step"] >= 3 and r.get("tokens_per_s")]
    if timed and tokens_per_step:
        st = [tokens_per_step / r["tokens_per_s"] for r in timed]
        rec["step_s_median"] = _median(st)
        rec["step_s_all"] = st
        rec["tokens_per_s_median"] = tokens_per_step / rec["step_s_median"]
        rec["mfu_median"] = _median([r["mfu"] for r in timed if "mfu" in r])
    for k in ("comm_bytes", "comm_bytes_grad", "comm_bytes_tp", "comm_bytes_cp", "comm_bytes_zero"):
        vals = [r[k] for r in steps if k in r]
        if vals:
            rec[k] = vals[-1]
    ranks = []
    for f in sorted(d.glob("bench_rank*.json")):
        b = json.loads(f.read_text())
        t = {k: _median(v[2:] if len(v) > 3 else v) for k, v in b["times"].items()}
        ranks.append({"rank": b["rank"], "rc": b["rc"], "error": b["error"], "peak_mem_gib": b.get("peak_mem_gib"),
                      "median_s": t, **({"stage": b["stage"]} if "stage" in b else {})})
        rec.setdefault("device", b.get("device"))
        rec.setdefault("torch", b.get("torch"))
    rec["ranks"] = ranks
    if (d / "memory.json").exists():
        rec["memory"] = json.loads((d / "memory.json").read_text()).get("model")
    if Path(log).exists():
        lines = [l for l in Path(log).read_text(errors="replace").splitlines() if l.strip()]
        bad = [l for l in lines if any(w in l for w in ("Error", "error", "OOM", "Traceback", "Killed"))]
        rec["log_tail"] = lines[-4:]
        rec["errors"] = bad[-6:]
    return rec


def _fmt(x, nd=1):
    return "" if x is None else f"{x:,.{nd}f}"


def read_runs(paths: list[str]) -> dict:
    """name -> run record, from JSON-lines files (a later record of the same name wins)."""
    runs = {}
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                runs[r["name"]] = r
    return runs


def report(paths: list[str]) -> str:
    runs = read_runs(paths)
    out = []
    out.append("| run | rc | steps | step ms (median) | tokens/s | MFU | comm bytes/step/rank (grad / tp / cp) | "
               "grad sync ms (min over ranks) | peak GiB (max rank) | final loss |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        gs = [x["median_s"].get("grad_sync") for x in r["ranks"] if x["median_s"].get("grad_sync")]
        gs = [min(gs)] if gs else gs  # the rank that waited least: the exchange itself
        peak = max([x["peak_mem_gib"] or 0 for x in r["ranks"]], default=None)
        comm = " / ".join(f"{r.get(k, 0):,}" for k in ("comm_bytes_grad", "comm_bytes_tp", "comm_bytes_cp")) \
            if "comm_bytes" in r else ""
        out.append(f"| {name} | {r['rc']} | {r['steps_done']} | {_fmt(r.get('step_s_median') and 1e3 * r['step_s_median'])} | "
                   f"{_fmt(r.get('tokens_per_s_median'), 0)} | {_fmt(r.get('mfu_median') and 100 * r['mfu_median'])}% | "
                   f"{comm} | {_fmt(1e3 * max(gs) if gs else None, 2)} | {_fmt(peak)} | "
                   f"{_fmt(r['loss'][-1] if r['loss'] else None, 4)} |")
    return "\n".join(out)


def loss_diff(runs: dict, a: str, b: str, n: int | None = None) -> dict | None:
    if a not in runs or b not in runs or not runs[a]["loss"] or not runs[b]["loss"]:
        return None
    la, lb = runs[a]["loss"][:n], runs[b]["loss"][:n]
    k = min(len(la), len(lb))
    d = [abs(x - y) for x, y in zip(la[:k], lb[:k]) if x is not None and y is not None]
    return {"steps": k, "max_abs": max(d), "last_abs": d[-1], "mean_abs": sum(d) / len(d),
            "max_rel": max(abs(x - y) / abs(y) for x, y in zip(la[:k], lb[:k]))}


PAIRS = [("dp2_1b_bf16sync", "ref1_1b_bf16"), ("dp2_1b_fp8sync", "ref1_1b_bf16"), ("dp2_1b_fp32sync", "ref1_1b_bf16"),
         ("tp2_1b_bf16", "ref1_1b_bf16"), ("pp2_1b_1f1b_m8", "ref1_1b_bf16"),
         ("dp2_1b_fp8tw", "ref1_1b_fp8tw"), ("dp2_1b_fp8tw_fp8sync", "ref1_1b_fp8tw"), ("tp2_1b_fp8tw", "ref1_1b_fp8tw"),
         ("tp2sp_1b_fp8tw", "ref1_1b_fp8tw"), ("cp2_ring_32k", "ref1_125m_32k"), ("cp2_rsa_32k_ckpt", "ref1_125m_32k"),
         ("tp2sp_125m_fp8tw_300", "ref1_125m_fp8tw_300"), ("dp2z1_125m_fp8tw_fp8sync_300", "ref1_125m_fp8tw_300")]


def compare(paths: list[str]) -> dict:
    """Loss differences against the one-GPU runs, and the pipeline bubble from each stage's compute alone."""
    runs = read_runs(paths)
    out = {"loss_vs_one_gpu": {}, "bubble": {}}
    for a, b in PAIRS:
        if a in runs and b in runs:
            out["loss_vs_one_gpu"][f"{a} vs {b}"] = {f"first_{n or 'all'}": loss_diff(runs, a, b, n) for n in (3, 9, None)}
    for name, r in runs.items():
        b = bubble(r)
        if b:
            out["bubble"][name] = b
    return out


def bubble(r: dict) -> dict | None:
    """A pipeline run's idle fraction per stage: 1 - its compute alone / its time in the schedule."""
    stages = [x for x in r["ranks"] if "stage" in x]
    if not stages or not all(x["median_s"].get("pipeline_run") for x in stages):
        return None
    raw = {}
    for x in stages:
        t_pipe = x["median_s"]["pipeline_run"]
        t_alone = statistics.median(x["stage"]["compute_s"])
        raw[f"stage{x['rank']}"] = {"blocks": x["stage"]["blocks"], "pipeline_run_s": t_pipe,
                                    "compute_alone_s": t_alone, "idle_fraction": 1 - t_alone / t_pipe}
    m, p = stages[0]["stage"]["n_micro"], len(stages)
    return {"micro_batches": m, "stages": p, "ideal_balanced": (p - 1) / (m + p - 1),
            "pipeline_steps_timed": r["steps_done"], **raw}


def outcome(r: dict) -> str:
    """ok, OOM, time limit, skipped or failed: what became of a sub-run."""
    if r["rc"] == 0:
        return "ok"
    if r.get("skipped"):
        return "skipped (time left)"
    text = " ".join([x.get("error") or "" for x in r["ranks"]] + r.get("errors", []))
    if "OOM" in text or "OutOfMemory" in text or "out of memory" in text:
        return "OOM"
    if r["rc"] in (124, 137):
        return "time limit"
    return f"failed (rc {r['rc']})"


def cp_report(paths: list[str]) -> str:
    """Part f's runs (cp2f_IMPL_LENk_...): zigzag vs plain step time at 32k, the longest sequence that trained."""
    runs = {n: r for n, r in read_runs(paths).items() if n.startswith("cp2f_")}
    out = ["| run | impl | seq | layout | checkpointing | outcome | steps | ms/step (median, steps 3+) | tokens/s | "
           "peak GiB (max rank) | CP bytes/step/rank |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    longest: dict[str, int] = {}
    for name, r in runs.items():
        impl, seq = name.split("_")[1:3]
        peak = max([x["peak_mem_gib"] or 0 for x in r["ranks"]], default=0) or None
        out.append(f"| {name} | {impl} | {seq} | {'plain' if 'plain' in name else 'zigzag'} | "
                   f"{'full' if name.endswith('ckpt') else 'none'} | {outcome(r)} | {r['steps_done']} | "
                   f"{_fmt(r.get('step_s_median') and 1e3 * r['step_s_median'])} | "
                   f"{_fmt(r.get('tokens_per_s_median'), 0)} | {_fmt(peak)} | {r.get('comm_bytes_cp', 0):,} |")
        if r["steps_done"]:
            longest[impl] = max(longest.get(impl, 0), int(seq[:-1]))
    out.append("")
    for impl in ("ring", "rsa"):
        z, p = (runs.get(f"cp2f_{impl}_32k_{lay}{'_ckpt' if impl == 'rsa' else ''}", {}).get("step_s_median")
                for lay in ("zigzag", "plain"))
        if z and p:
            out.append(f"{impl} 32k: plain / zigzag step time = {p / z:.3f}")
    out.append("longest sequence that trained at least one step: "
               + ", ".join(f"{impl} {longest[impl]}k" for impl in sorted(longest)) if longest else "none trained")
    return "\n".join(out)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "train":
        sys.exit(train(sys.argv[2:]))
    elif mode == "collect":
        print(json.dumps(collect(*sys.argv[2:6])))
    elif mode == "compare":
        print(json.dumps(compare(sys.argv[2:]), indent=1))
    elif mode == "report":
        print(report(sys.argv[2:]))
    elif mode == "cp":
        print(cp_report(sys.argv[2:]))
    elif mode == "tables":
        from multi_gpu_tables import main as tables_main

        sys.exit(tables_main(sys.argv[2:]))
