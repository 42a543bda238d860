"""Data-parallel gradient exchange (GradSync.sync) on the `1b` preset's gradient shapes: the code before commit
fp8-sync (BaselineGradSync below, a verbatim copy of src/lowbit/distributed/grad_sync.py at 81abf2b) against the
current GradSync, in the same process, fp32 / bf16 / fp8; bit-for-bit comparison of their results; a profile of one
fp8 exchange of each.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/grad_sync_bench.py --out results.json
    CPU check of the script (gloo, tiny shapes):
        PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/grad_sync_bench.py --device cpu --preset tiny --iters 2

Time per exchange: wall clock of sync() with the device synchronised before and after (as the trainer's
"grad sync ms"), and CUDA events around it; median of --iters after --warmup, per rank, gradients restored before
every call (not timed). Gradients: random normal times 10^U(-4, 0) per element and a per-tensor magnitude, one seed per
rank (heavy tails: FP8 underflow, saturation and -0 all occur).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from lowbit.distributed import grad_sync as new_impl
from lowbit.distributed.grad_sync import GradSync
from lowbit.errors import LowbitError
from lowbit.numerics.formats import get_format
from lowbit.models.llama import PRESETS, Llama, ModelArgs, swiglu_hidden
from lowbit.optim.grad_scaling import AutoScale
from lowbit.optim.precision import pow2_scale

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
BUCKET = 1 << 25


# ---------------------------------------------------------------------------------------------------------------
# BASELINE: GradSync as it was at commit 81abf2b (one flat fp32 copy, per-element scale vector), kept verbatim.
# ---------------------------------------------------------------------------------------------------------------
class BaselineGradSync:
    def __init__(self, group, mode: str = "fp32", fmt: str = "e4m3", scaling: str = "auto"):
        if mode not in ("fp32", "bf16", "fp8"):
            raise LowbitError(f"parallel.grad_sync: {mode!r} is not one of fp32, bf16, fp8")
        if scaling not in ("pre", "post", "auto"):
            raise LowbitError(f"parallel.grad_scaling: {scaling!r} is not one of pre, post, auto")
        self.group, self.mode, self.scaling = group, mode, scaling
        self.fmt = get_format(fmt)
        self.world = dist.get_world_size(group) if group is not None else 1
        self.auto = AutoScale(self.world)
        self.bytes_sent = 0  # since the last reset (the trainer reports it per step)
        self.overflow_ratio = 0.0  # of the last fp8 exchange

    # ---- which tensors ----
    @staticmethod
    def _slots(optimizer) -> list:
        """(param, store or None) for every trainable parameter, in the same order on every rank."""
        stores = getattr(optimizer, "_grads", {})
        return [(p, stores.get(p)) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    @torch.no_grad()
    def sync(self, optimizer) -> None:
        if self.world == 1:
            return
        slots = self._slots(optimizer)
        values = []
        for p, store in slots:
            if store is not None:
                values.append(store.value() if store.filled else torch.zeros(p.shape, device=p.device))
            else:
                values.append(p.grad.float() if p.grad is not None else torch.zeros(p.shape, device=p.device))
        flat = torch.cat([v.reshape(-1) for v in values])
        scales, bad = self._shared_scales(values) if self.mode == "fp8" else (None, None)
        over = torch.zeros((), device=flat.device)
        for start in range(0, flat.numel(), BUCKET):
            part = flat[start:start + BUCKET]
            if self.mode == "fp8":
                mean, o = self._fp8_mean(part, scales[start:start + BUCKET])
                part.copy_(mean)
                over += o
            else:
                part.copy_(self._mean(part))
        if self.mode == "fp8":
            dist.all_reduce(over, group=self.group)
            self.bytes_sent += self._ring_bytes(1, 4)
            self.overflow_ratio = over.item() / max(flat.numel(), 1)
            if self.scaling == "auto":
                self.auto.update(self.overflow_ratio)
            if bad:  # a non-finite gradient on any rank: every rank sees NaN, and the step is skipped everywhere
                flat.fill_(float("nan"))
        offset = 0
        for (p, store), v in zip(slots, values):
            mean = flat[offset:offset + v.numel()].view(p.shape)
            offset += v.numel()
            if store is not None:
                store.clear()
                store.add(mean)
            elif p.grad is not None:
                p.grad.copy_(mean)
            else:
                p.grad = mean.to(p.dtype).clone()

    # ---- one bucket ----
    def _ring_bytes(self, numel: int, itemsize: int) -> int:
        return 2 * (self.world - 1) * numel * itemsize // self.world

    def _mean(self, x: torch.Tensor) -> torch.Tensor:
        n = self.world
        if self.mode == "fp32":
            y = x.clone()
            dist.all_reduce(y, group=self.group)
            self.bytes_sent += self._ring_bytes(y.numel(), 4)
            return y / n
        y = x.to(torch.bfloat16)
        dist.all_reduce(y, group=self.group)
        self.bytes_sent += self._ring_bytes(y.numel(), 2)
        return y.float() / n

    def _shared_scales(self, values: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """Per element of the flat gradient: its tensor's shared scale (from the amax over all ranks, one
        all-reduce MAX for every tensor) times the scaling mode's factor; and whether any rank has a non-finite
        gradient."""
        amax = torch.stack([v.abs().amax() for v in values]).float()
        bad = ~torch.isfinite(amax).all()
        stats = torch.cat([torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax)), bad.float().view(1)])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group)
        self.bytes_sent += self._ring_bytes(stats.numel(), 4)
        factor = {"pre": 1.0 / self.world, "post": 1.0, "auto": self.auto.mu}[self.scaling]
        scale = pow2_scale(stats[:-1], self.fmt.max, torch.ones_like(stats[:-1])) * factor
        sizes = torch.tensor([v.numel() for v in values], device=scale.device)
        return torch.repeat_interleave(scale, sizes), bool(stats[-1] > 0)

    def _fp8_mean(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean over ranks of x (scaled by `scale`, shared by all ranks), FP8 on the wire; and the number of
        shard sums that saturated."""
        n, f = self.world, self.fmt
        numel = x.numel()
        pad = (-numel) % n
        if pad:
            x, scale = torch.cat([x, x.new_zeros(pad)]), torch.cat([scale, scale.new_ones(pad)])
        q = (x * scale).clamp_(-f.max, f.max).to(f.torch_dtype)
        # reduce-scatter: rank r receives everyone's shard r (FP8 bytes) and sums it in fp32 (same scales on
        # every rank, so the scaled values add directly)
        received = torch.empty_like(q.view(torch.uint8))
        dist.all_to_all_single(received, q.view(torch.uint8), group=self.group)
        self.bytes_sent += (n - 1) * q.numel() // n
        shard = received.view(f.torch_dtype).view(n, -1).float().sum(0)
        over = (shard.abs() > f.max).sum().float()
        shard_q = shard.clamp_(-f.max, f.max).to(f.torch_dtype)
        gathered = torch.empty_like(q.view(torch.uint8))
        _all_gather(gathered, shard_q.view(torch.uint8), group=self.group)
        self.bytes_sent += (n - 1) * q.numel() // n
        return (gathered.view(f.torch_dtype).float() / (scale * n))[:numel], over

    def state_dict(self) -> dict:
        return {"auto": self.auto.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.auto.load_state_dict(state["auto"])


# ---------------------------------------------------------------------------------------------------------------
def shapes(preset: str) -> list[tuple[int, ...]]:
    p = dict(PRESETS[preset])
    ffn = p.get("ffn_dim") or swiglu_hidden(p["dim"], p["ffn_multiple_of"])
    a = ModelArgs(dim=p["dim"], n_layers=p["n_layers"], n_heads=p["n_heads"], n_kv_heads=p["n_kv_heads"],
                  ffn_dim=ffn, vocab_size=p["vocab_size"] or 4096, max_seq_len=64,
                  tie_embeddings=p["tie_embeddings"])
    with torch.device("meta"):
        m = Llama(a)
    return [tuple(q.shape) for q in m.parameters()]


def make_grads(shp, rank, device, nan=False):
    g = torch.Generator(device=device).manual_seed(1234 + rank)
    out = []
    for i, s in enumerate(shp):
        mag = 10.0 ** (-6 + 4 * torch.rand((), generator=g, device=device))
        t = torch.randn(s, generator=g, device=device) * mag
        t *= 10.0 ** (-4 * torch.rand(s, generator=g, device=device))
        out.append(t)
    if nan and rank == 0:
        out[len(out) // 2].view(-1)[7] = float("nan")
    return out


def restore(params, saved):
    for p, s in zip(params, saved):
        p.grad.copy_(s)


def sync_dev(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_sync(sync, opt, params, saved, device, warmup, iters):
    wall, ev = [], []
    for i in range(warmup + iters):
        restore(params, saved)
        sync_dev(device)
        dist.barrier()
        sync_dev(device)
        if device.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        sync.sync(opt)
        if device.type == "cuda":
            e1.record()
        sync_dev(device)
        t1 = time.perf_counter()
        if i >= warmup:
            wall.append((t1 - t0) * 1e3)
            if device.type == "cuda":
                ev.append(e0.elapsed_time(e1))
    return {"wall_ms_median": statistics.median(wall), "wall_ms_min": min(wall), "wall_ms_max": max(wall),
            "event_ms_median": statistics.median(ev) if ev else None, "n": iters}


def time_comm(device, numel, warmup, iters):
    """The collectives alone on buffers of the exchange's size: the floor for fp8 (all-to-all + all-gather of
    1-byte values) and bf16 / fp32 (all-reduce)."""
    out = {}
    n = dist.get_world_size()
    u8 = torch.zeros(numel, dtype=torch.uint8, device=device)
    r8 = torch.empty_like(u8)
    shard = torch.zeros(numel // n, dtype=torch.uint8, device=device)
    cases = {
        "fp8_all_to_all+all_gather": lambda: (dist.all_to_all_single(r8, u8), _all_gather(r8, shard)),
        "bf16_all_reduce": None, "fp32_all_reduce": None,
    }
    for name in list(cases):
        if name.startswith("bf16") or name.startswith("fp32"):
            dt = torch.bfloat16 if name.startswith("bf16") else torch.float32
            buf = torch.zeros(numel, dtype=dt, device=device)
            cases[name] = (lambda b: (lambda: [dist.all_reduce(b[s:s + BUCKET]) for s in range(0, numel, BUCKET)]))(buf)
        ts = []
        for i in range(warmup + iters):
            sync_dev(device)
            dist.barrier()
            sync_dev(device)
            t0 = time.perf_counter()
            cases[name]()
            sync_dev(device)
            if i >= warmup:
                ts.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(ts)
        cases[name] = None
    return out


def bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def compare(params, saved, opt, group, mode, fmt, scaling, calls, compile_):
    """Run the baseline and the new code `calls` times each from the same gradients (state carried between calls,
    as in training); True where every gradient, the overflow ratio, the bytes and mu agree bit for bit."""
    base = BaselineGradSync(group, mode, fmt, scaling)
    new = GradSync(group, mode, fmt, scaling, compile=compile_)
    res = []
    for c in range(calls):
        restore(params, saved)
        base.bytes_sent = 0
        base.sync(opt)
        ref = [p.grad.clone() for p in params]
        restore(params, saved)
        new.bytes_sent = 0
        new.sync(opt)
        diff = [i for i, (p, r) in enumerate(zip(params, ref)) if not torch.equal(bits(p.grad), bits(r))]
        nan_all = all(bool(torch.isnan(p.grad).all()) for p in params)
        maxabs = max((float((p.grad - r).abs().nan_to_num(0).max()) for p, r in zip(params, ref)), default=0.0)
        same = (not diff and base.overflow_ratio == new.overflow_ratio and base.bytes_sent == new.bytes_sent
                and base.auto.mu == new.auto.mu)
        flag = torch.tensor([0.0 if same else 1.0], device=params[0].device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        res.append({"call": c, "bit_identical_all_ranks": flag.item() == 0, "tensors_differing_rank": len(diff),
                    "max_abs_diff_rank": maxabs, "overflow_ratio": [base.overflow_ratio, new.overflow_ratio],
                    "bytes": [base.bytes_sent, new.bytes_sent], "mu_after": [base.auto.mu, new.auto.mu],
                    "all_nan": nan_all, "new_compile_flag_after": new.compile})
        del ref
    return res


def profile_one(sync, opt, params, saved, device, rows=14):
    restore(params, saved)
    sync_dev(device)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        sync.sync(opt)
        sync_dev(device)
    ka = prof.key_averages()
    key = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    if device.type != "cuda":
        key = "self_cpu_time_total"
    evs = sorted(ka, key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in ka)
    top = [{"name": e.key[:90], "self_ms": getattr(e, key) / 1e3, "calls": e.count} for e in evs[:rows]]
    return {"metric": key, "sum_self_ms": total / 1e3, "top": top}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="1b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--out", default="grad_sync_bench.json")
    ap.add_argument("--skip-compare", action="store_true")
    ap.add_argument("--bucket", type=int, default=0, help="elements per bucket, both implementations (0: theirs)")
    ap.add_argument("--compile", type=int, default=-1, help="new fp8 path: 1 fused (torch.compile), 0 eager, "
                    "-1 both on cuda / eager on cpu")
    args = ap.parse_args()
    if args.bucket:
        global BUCKET
        BUCKET = new_impl.BUCKET = args.bucket
    cuda = args.device == "cuda"
    rank = int(os.environ["RANK"])
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    group = dist.group.WORLD
    world = dist.get_world_size()
    t_start = time.time()
    meta = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.basename(sys.executable), "-m torch.distributed.run"] + sys.argv),
            "world": world, "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "env": {k: v for k, v in os.environ.items() if "NVLS" in k or "MULTICAST" in k},
            "preset": args.preset, "bucket": new_impl.BUCKET}
    shp = shapes(args.preset)
    params = [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shp]
    saved = make_grads(shp, rank, device)
    for p, s in zip(params, saved):
        p.grad = s.clone()
    opt = torch.optim.SGD(params, lr=0.1)
    numel = sum(p.numel() for p in params)
    meta.update(params=len(params), grad_elements=numel)
    if rank == 0:
        print(json.dumps(meta), flush=True)
    result = {"meta": meta, "timing": {}, "compare": {}, "profile": {}}

    compiles = [1, 0] if (args.compile == -1 and cuda) else ([0] if args.compile == -1 else [args.compile])
    # ---- bit-for-bit: new vs baseline (also compiles the fused steps before timing) ----
    if not args.skip_compare:
        cases = [("fp32", "e4m3", "auto", 1, None), ("bf16", "e4m3", "auto", 1, None)]
        for c in compiles:
            cases += [("fp8", "e4m3", "auto", 3, c), ("fp8", "e4m3", "pre", 1, c), ("fp8", "e4m3", "post", 1, c),
                      ("fp8", "e5m2", "auto", 1, c)]
        for mode, fmt, scaling, calls, c in cases:
            t0 = time.time()
            r = compare(params, saved, opt, group, mode, fmt, scaling, calls, bool(c) if c is not None else None)
            name = f"{mode}_{fmt}_{scaling}" + ("" if c is None else f"_compile{c}")
            result["compare"][name] = r
            if rank == 0:
                print(f"compare {name}: {[x['bit_identical_all_ranks'] for x in r]} compile={r[-1]['new_compile_flag_after']} "
                      f"ovf={[x['overflow_ratio'] for x in r]} ({time.time() - t0:.1f}s)", flush=True)
        nan_saved = make_grads(shp, rank, device, nan=True)
        for c in compiles:
            r = compare(params, nan_saved, opt, group, "fp8", "e4m3", "auto", 1, bool(c))
            result["compare"][f"fp8_e4m3_auto_nan_on_rank0_compile{c}"] = r
            if rank == 0:
                print(f"compare nan compile{c}: {r}", flush=True)
        del nan_saved
    # ---- timing ----
    runs = [("fp32", "baseline", lambda: BaselineGradSync(group, "fp32")),
            ("fp32", "new", lambda: GradSync(group, "fp32")),
            ("bf16", "baseline", lambda: BaselineGradSync(group, "bf16")),
            ("bf16", "new", lambda: GradSync(group, "bf16")),
            ("fp8", "baseline", lambda: BaselineGradSync(group, "fp8", "e4m3", "auto"))]
    for c in compiles:
        runs.append(("fp8", f"new_compile{c}", (lambda cc: lambda: GradSync(group, "fp8", "e4m3", "auto",
                                                                              compile=bool(cc)))(c)))
    for mode, impl, mk in runs:
        r = time_sync(mk(), opt, params, saved, device, args.warmup, args.iters)
        allr = [None] * world
        dist.all_gather_object(allr, r)
        result["timing"][f"{mode}_{impl}"] = {"per_rank": allr,
                                              "wall_ms_median_max_over_ranks": max(x["wall_ms_median"] for x in allr),
                                              "wall_ms_median_min_over_ranks": min(x["wall_ms_median"] for x in allr)}
        if rank == 0:
            print(f"time {mode:4s} {impl:16s} wall median {r['wall_ms_median']:.2f} ms (ranks: "
                  f"{[round(x['wall_ms_median'], 2) for x in allr]}) events {r['event_ms_median']}", flush=True)
    result["comm_only_ms_rank0"] = time_comm(device, numel, args.warmup, max(args.iters // 2, 3)) if cuda else None
    if rank == 0:
        print("comm only:", result["comm_only_ms_rank0"], flush=True)
    # ---- where the time goes: one fp8 exchange of each ----
    profs = [("baseline", BaselineGradSync(group, "fp8", "e4m3", "auto"))]
    profs += [(f"new_compile{c}", GradSync(group, "fp8", "e4m3", "auto", compile=bool(c))) for c in compiles]
    for name, s in profs:
        s.sync(opt)  # warm
        result["profile"][f"fp8_{name}"] = p = profile_one(s, opt, params, saved, device)
        if rank == 0:
            print(f"profile fp8 {name}: sum of self {p['metric']} {p['sum_self_ms']:.1f} ms", flush=True)
            for e in p["top"]:
                print(f"   {e['self_ms']:9.3f} ms  x{e['calls']:<5d} {e['name']}", flush=True)
    result["meta"]["bench_seconds"] = time.time() - t_start
    if rank == 0:
        result["meta"].setdefault("date", result["meta"].get("date_utc"))  # the key report.py's line reads
        columns, rows = exchange_table(result)
        result["tables"] = {"exchange": {"title": columns[0][1], "columns": columns, "rows": rows, "notes": []}}
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        print("wrote", args.out, flush=True)
    dist.barrier()
    dist.destroy_process_group()


def exchange_table(result: dict) -> tuple[list, list[dict]]:
    """BENCHMARKS.md's table (benchmarks/report.py renders it): ms of the slower rank per exchange, the baseline's,
    the current one's and its collectives' alone."""
    ms = {k: v["wall_ms_median_max_over_ranks"] for k, v in result["timing"].items()}
    comm = result.get("comm_only_ms_rank0", {})
    n = math.ceil(result["meta"]["grad_elements"] / result["meta"]["bucket"])

    def f(x):
        return "" if x is None else f"{x:.1f}"

    eager = f" (eager, `LOWBIT_GRAD_SYNC_COMPILE=0`: {f(ms['fp8_new_compile0'])})" if "fp8_new_compile0" in ms else ""
    fp8 = ms.get("fp8_new_compile1", ms.get("fp8_new_compile0"))
    rows = [{"exchange": "fp32 all-reduce", "baseline": f(ms.get("fp32_baseline")), "current": f(ms.get("fp32_new")),
             "alone": f"{f(comm.get('fp32_all_reduce'))} ({n} all-reduces)"},
            {"exchange": "bf16 all-reduce", "baseline": f(ms.get("bf16_baseline")), "current": f(ms.get("bf16_new")),
             "alone": f"{f(comm.get('bf16_all_reduce'))} ({n} all-reduces)"},
            {"exchange": "fp8 (e4m3, auto)", "baseline": f(ms.get("fp8_baseline")), "current": f(fp8) + eager,
             "alone": f"{f(comm.get('fp8_all_to_all+all_gather'))} (one all-to-all + one all-gather)"}]
    columns = [["exchange", "exchange, ms", ""], ["baseline", "baseline (`BaselineGradSync`)", ""],
               ["current", "current", ""], ["alone", "the collectives alone, same bytes", ""]]
    return columns, rows


if __name__ == "__main__":
    main()
