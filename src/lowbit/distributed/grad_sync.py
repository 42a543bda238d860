"""Data-parallel gradient exchange: every replica ends with the mean of all replicas' gradients.

    fp32  all-reduce in fp32 (the reference)
    bf16  all-reduce in bf16 (half the bytes; the sum is rounded to bf16 as it goes)
    fp8   FP8-LM's exchange without summing in FP8: one shared scale per gradient tensor (from its global amax,
          one all-reduce MAX for all tensors), the gradients cast to FP8 under it (pre-, post- or automatic
          scaling, as `optim.grad_scaling.fp8_sum`),
          a reduce-scatter built from an all-to-all of the FP8 bytes with the sum of each shard taken in fp32,
          the shard sums cast back to FP8 under the same scale (post scaling may saturate here: what auto
          scaling's mu watches), and an all-gather of those bytes. 2·(N−1)/N bytes per gradient element on the
          wire, against 4·(N−1)/N for a bf16 ring all-reduce.

Gradients are read wherever the optimizer keeps them (`p.grad`, or a low-precision GradStore) and written back
there. `bytes_sent` counts what this rank puts on the wire, ring all-reduce counted as 2·(N−1)/N of the payload.

How (the numerics are those of one flat fp32 copy of every gradient cut into buckets of BUCKET elements): each
bucket is gathered from the gradients it overlaps into an fp32 staging buffer, exchanged, and its mean written
straight back into those gradients; the next bucket is prepared while the collectives of the last one run
(async collectives, so the comm overlaps the casts). The fp8 scale is applied per chunk of C elements (C divides
every tensor's size: a per-tensor scale as a small [chunks, 1] vector broadcast over [chunks, C]), never as a
per-element vector. On CUDA the elementwise steps (scale, clamp, cast; shard sum, overflow count, recast; decode)
are fused with torch.compile where the result is provably the same bits as the eager ops (see `_fused_ok`);
elsewhere, and if compiling fails, the eager ops run. One host sync per fp8 exchange (overflow count and the
non-finite flag, read together at the end).
"""

from __future__ import annotations

import math
import os
import warnings
from functools import lru_cache

import torch
import torch.distributed as dist

from lowbit.errors import LowbitError
from lowbit.numerics.formats import get_format
from lowbit.optim.grad_scaling import AutoScale
from lowbit.optim.precision import pow2_scale

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
BUCKET = 1 << 25  # elements per exchange (128 MiB of fp32): bounds the extra memory of the staging copies
MAX_CHUNK = 1 << 16  # elements sharing one scale entry in the fp8 path (at most; C divides every tensor size)


def _is_pow2(x: float) -> bool:
    m, _ = math.frexp(x)
    return x > 0 and m == 0.5


# ---- fused elementwise steps (CUDA, torch.compile), each the same bits as its eager twin above ----
def _quant_eager(x, s, fmax, dtype):
    return (x * s).clamp_(-fmax, fmax).to(dtype)


def _mid_eager(r, fmax, dtype):
    shard = r.float().sum(0)
    over = (shard.abs() > fmax).sum()
    return shard.clamp_(-fmax, fmax).to(dtype), over


def _quant_fused(x, s, fmax: float, dtype):
    return (x * s).clamp(-fmax, fmax).to(dtype)


def _mid_fused(r, fmax: float, dtype):
    acc = r[0].float()
    for i in range(1, r.shape[0]):
        acc = acc + r[i].float()
    acc = torch.where(acc == 0, 0.0, acc)  # eager sum starts from +0: a sum of zeros is +0, never -0
    over = (acc.abs() > fmax).sum()
    return acc.clamp(-fmax, fmax).to(dtype), over


def _deq_fused(g, recip):
    return g.float() * recip  # == g.float() / d bit for bit when d is a power of two (1/d exact, one rounding)


@lru_cache(maxsize=None)
def _compiled(name: str, fmax: float, dtype):
    if name == "quant":
        def fn(x, s):
            return _quant_fused(x, s, fmax, dtype)
    elif name == "mid":
        def fn(r):
            return _mid_fused(r, fmax, dtype)
    else:
        fn = _deq_fused
    return torch.compile(fn, dynamic=True, fullgraph=True)


class _Layout:
    """Where every bucket of the flat gradient comes from: pieces (slot, start, end, offset in bucket), the chunk
    size C and, per bucket, which tensor owns each chunk."""

    def __init__(self, numels: list[int], world: int, device, owners: bool):
        self.numels = numels
        self.total = total = sum(numels)
        c = BUCKET
        for n in numels:
            c = math.gcd(c, n) if n else c
        c = math.gcd(c, total) if total else 1
        self.chunk = max(math.gcd(c, MAX_CHUNK), 1)  # still divides every size (MAX_CHUNK is a power of two)
        offsets = [0]
        for n in numels:
            offsets.append(offsets[-1] + n)
        self.buckets = []
        i = 0
        for start in range(0, total, BUCKET):
            end = min(start + BUCKET, total)
            pieces = []
            while i < len(numels) and offsets[i + 1] <= start:
                i += 1
            j = i
            while j < len(numels) and offsets[j] < end:
                a, b = max(offsets[j], start), min(offsets[j + 1], end)
                if b > a:
                    pieces.append((j, a - offsets[j], b - offsets[j], a - start))
                j += 1
            owner = None  # only the fp8 path scales per tensor
            if owners:
                owner = torch.repeat_interleave(torch.tensor([p[0] for p in pieces], dtype=torch.int32),
                                                torch.tensor([(p[2] - p[1]) // self.chunk for p in pieces])).to(device)
            numel = end - start
            self.buckets.append((numel, (-numel) % world, pieces, owner))


class GradSync:
    def __init__(self, group, mode: str = "fp32", fmt: str = "e4m3", scaling: str = "auto",
                 compile: bool | None = None):
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
        # None: fuse the fp8 elementwise steps with torch.compile on CUDA (LOWBIT_GRAD_SYNC_COMPILE=0 turns it off)
        self.compile = compile
        self._layout = None

    # ---- which tensors ----
    @staticmethod
    def _slots(optimizer) -> list:
        """(param, store or None) for every trainable parameter, in the same order on every rank."""
        stores = getattr(optimizer, "_grads", {})
        return [(p, stores.get(p)) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    def _use_compile(self, device) -> bool:
        if self.compile is None:
            return device.type == "cuda" and os.environ.get("LOWBIT_GRAD_SYNC_COMPILE", "1") != "0"
        return self.compile

    def _fused_ok(self) -> bool:
        """The fused shard sum adds the N values in its own order: the same bits as eager's sum(0) when every
        partial sum is exact (E4M3 values are multiples of 2^-9 below 2^9: exact in fp32 for N <= 64) or there is
        one addition (N = 2)."""
        return self.world == 2 or (self.fmt.name == "e4m3" and self.world <= 64)

    @torch.no_grad()
    def sync(self, optimizer) -> None:
        if self.world == 1:
            return
        slots = self._slots(optimizer)
        # sources (read) and destinations (written); a destination None collects the mean in a full fp32 tensor
        srcs, dests = [], []
        for p, store in slots:
            if store is not None:
                srcs.append(store.value() if store.filled else torch.zeros(p.shape, device=p.device))
                dests.append(None)
            elif p.grad is not None:
                srcs.append(p.grad)
                dests.append(p.grad.view(-1) if p.grad.is_contiguous() else None)
            else:
                srcs.append(torch.zeros(p.shape, device=p.device))
                dests.append(None)
        fulls = [None if d is not None else torch.empty(p.numel(), device=p.device) for (p, _), d in zip(slots, dests)]
        outs = [d if d is not None else f for d, f in zip(dests, fulls)]
        flat_srcs = [s.reshape(-1) for s in srcs]
        numels = [s.numel() for s in flat_srcs]
        device = flat_srcs[0].device if flat_srcs else torch.device("cpu")
        if self._layout is None or self._layout.numels != numels:
            self._layout = _Layout(numels, self.world, device, owners=self.mode == "fp8")
        lay = self._layout
        if self.mode == "fp8":
            bad = self._sync_fp8(lay, flat_srcs, outs, device)
            if bad:  # a non-finite gradient on any rank: every rank sees NaN, and the step is skipped everywhere
                for o in outs:
                    o.fill_(float("nan"))
        else:
            self._sync_plain(lay, flat_srcs, outs)
        for (p, store), full in zip(slots, fulls):
            if full is None:
                continue
            mean = full.view(p.shape)
            if store is not None:
                store.clear()
                store.add(mean)
            elif p.grad is not None:
                p.grad.copy_(mean)
            else:
                p.grad = mean.to(p.dtype)

    # ---- helpers ----
    def _ring_bytes(self, numel: int, itemsize: int) -> int:
        return 2 * (self.world - 1) * numel * itemsize // self.world

    @staticmethod
    def _stage(srcs, pieces, numel, dtype, device) -> torch.Tensor:
        parts = [srcs[j][a:b] for j, a, b, _ in pieces]
        out = torch.empty(numel, dtype=dtype, device=device)
        if len(parts) == 1 and parts[0].dtype == dtype:
            out.copy_(parts[0])
        else:
            torch.cat(parts, out=out)
        return out

    # ---- fp32 / bf16: one all-reduce per bucket, the next bucket staged while it runs ----
    def _sync_plain(self, lay, srcs, outs) -> None:
        n = self.world
        dtype = torch.float32 if self.mode == "fp32" else torch.bfloat16
        itemsize = 4 if self.mode == "fp32" else 2
        pending = None
        for numel, _, pieces, _ in lay.buckets:
            y = self._stage(srcs, pieces, numel, dtype, srcs[0].device)
            work = dist.all_reduce(y, group=self.group, async_op=True)
            self.bytes_sent += self._ring_bytes(numel, itemsize)
            if pending is not None:
                self._plain_back(*pending, outs, n)
            pending = (work, y, pieces)
        if pending is not None:
            self._plain_back(*pending, outs, n)

    def _plain_back(self, work, y, pieces, outs, n) -> None:
        work.wait()
        if y.dtype != torch.float32:
            y = y.float()
        for j, a, b, off in pieces:
            torch.div(y[off:off + b - a], n, out=outs[j][a:b])  # fp32 quotient, one rounding to the gradient dtype

    # ---- fp8 ----
    def _scales(self, srcs) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Per tensor: its shared scale (from the amax over all ranks, one all-reduce MAX for every tensor) times
        the scaling mode's factor; the device flag 'some rank has a non-finite gradient'; whether every scale·N is
        a power of two (then decoding may multiply by its exact reciprocal)."""
        amax = torch.stack([a.float() for a in torch._foreach_norm(srcs, float("inf"))])  # max |x|, NaN propagates
        bad = ~torch.isfinite(amax).all()
        stats = torch.cat([torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax)), bad.float().view(1)])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group)
        self.bytes_sent += self._ring_bytes(stats.numel(), 4)
        factor = {"pre": 1.0 / self.world, "post": 1.0, "auto": self.auto.mu}[self.scaling]
        scale = pow2_scale(stats[:-1], self.fmt.max, torch.ones_like(stats[:-1])) * factor
        return scale, stats[-1], _is_pow2(factor) and _is_pow2(self.world)

    def _sync_fp8(self, lay, srcs, outs, device) -> bool:
        n, f = self.world, self.fmt
        scale, bad, pow2 = self._scales(srcs)
        div = scale * n
        recip = 1.0 / div if pow2 else None
        fused = self._use_compile(device)
        over = torch.zeros((), device=device)
        c = lay.chunk
        stage1 = stage2 = None  # bucket waiting for its all-to-all / for its all-gather
        for numel, pad, pieces, owner in lay.buckets:
            x = self._stage(srcs, pieces, numel, torch.float32, device)
            q = self._run(fused, "quant", x.view(-1, c), scale[owner].view(-1, 1)).view(-1)
            if pad:
                q = torch.cat([q.view(torch.uint8), q.new_zeros(pad, dtype=torch.uint8)]).view(f.torch_dtype)
            # reduce-scatter: rank r receives everyone's shard r (FP8 bytes) and sums it in fp32 (same scales on
            # every rank, so the scaled values add directly)
            received = torch.empty_like(q.view(torch.uint8))
            work = dist.all_to_all_single(received, q.view(torch.uint8), group=self.group, async_op=True)
            self.bytes_sent += (n - 1) * q.numel() // n
            del x
            if stage2 is not None:
                self._fp8_back(*stage2, outs, fused, div, recip, c)
                stage2 = None
            if stage1 is not None:
                stage2 = self._fp8_mid(*stage1, over, fused and self._fused_ok())
            stage1 = (work, received, q, numel, pieces, owner)
        if stage2 is not None:
            self._fp8_back(*stage2, outs, fused, div, recip, c)
        if stage1 is not None:
            self._fp8_back(*self._fp8_mid(*stage1, over, fused and self._fused_ok()), outs, fused, div, recip, c)
        dist.all_reduce(over, group=self.group)
        self.bytes_sent += self._ring_bytes(1, 4)
        over_v, bad_v = torch.stack([over, bad]).tolist()  # the one host sync
        self.overflow_ratio = over_v / max(lay.total, 1)
        if self.scaling == "auto":
            self.auto.update(self.overflow_ratio)
        return bad_v > 0

    def _fp8_mid(self, work, received, q, numel, pieces, owner, over, fused):
        n, f = self.world, self.fmt
        work.wait()
        shard_q, o = self._run(fused, "mid", received.view(f.torch_dtype).view(n, -1))
        over += o.float()
        gathered = torch.empty_like(q.view(torch.uint8))
        work = _all_gather(gathered, shard_q.view(torch.uint8), group=self.group, async_op=True)
        self.bytes_sent += (n - 1) * q.numel() // n
        return work, gathered, numel, pieces, owner

    def _fp8_back(self, work, gathered, numel, pieces, owner, outs, fused, div, recip, c) -> None:
        work.wait()
        g = gathered.view(self.fmt.torch_dtype)[:numel].view(-1, c)
        if recip is not None and fused and self.compile is not False:
            mean = self._run(fused, "deq", g, recip[owner].view(-1, 1)).view(-1)
        else:  # the eager ops of the one-flat-buffer exchange
            mean = (g.float() / div[owner].view(-1, 1)).view(-1)
        for j, a, b, off in pieces:
            outs[j][a:b].copy_(mean[off:off + b - a])

    def _run(self, fused: bool, name: str, *args):
        f = self.fmt
        if fused and self.compile is not False:
            try:
                return _compiled(name, f.max, f.torch_dtype)(*args)
            except Exception as e:  # no working compiler here: the eager ops, same results
                warnings.warn(f"grad_sync: torch.compile of the fp8 {name} step failed ({type(e).__name__}: {e}); "
                              "running it eagerly", stacklevel=2)
                self.compile = False
        if name == "quant":
            return _quant_eager(*args, f.max, f.torch_dtype)
        if name == "mid":
            return _mid_eager(*args, f.max, f.torch_dtype)
        g, recip = args
        return g.float() * recip  # only with scale·N a power of two: the same bits as g.float() / (scale·N)

    def state_dict(self) -> dict:
        return {"auto": self.auto.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.auto.load_state_dict(state["auto"])
