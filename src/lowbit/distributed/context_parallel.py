"""Context (sequence) parallelism: each of cp ranks holds a slice of every sequence; attention circulates K/V
around a ring of point-to-point transfers (batch_isend_irecv), so no rank ever holds the whole sequence's K/V.

The split (parallel.cp_layout): zigzag, for causal load balance, cuts the sequence into 2·cp chunks and rank r
holds chunks r and 2·cp−1−r, so every rank has as many unmasked query-key pairs; plain gives rank r the contiguous
chunk r, so its queries see the K/V of ranks 0..r only: the later blocks are fully masked (ring skips them: the
last rank computes cp blocks, the first one; rsa skips only their QKᵀ, not the products with V nor the backward).
Positions travel with the shards: RoPE uses them and
the causal mask compares them.

    ring  online softmax (as flash attention across devices): each arriving K/V block updates the output and the
          running log-sum-exp; the next block is in flight while this one is computed. Backward circulates K/V
          again with their dK/dV accumulators, which come home after a full turn.
    rsa   the sequence-parallelism paper's ring self-attention: stage one circulates keys so each query slice
          gets its full score rows (softmax is then local), stage two circulates values. Stores Lq×L scores.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowbit.errors import LowbitError


def zigzag_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions rank `rank` of `cp` holds: chunks rank and 2·cp−1−rank of 2·cp."""
    if seq_len % (2 * cp):
        raise LowbitError(f"sequence length {seq_len} must be divisible by 2*cp = {2 * cp}")
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def shard_positions(seq_len: int, cp: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """The positions rank `rank` of `cp` holds under `layout`: zigzag, or plain (the contiguous chunk rank of cp)."""
    if layout == "zigzag":
        return zigzag_positions(seq_len, cp, rank)
    if layout != "plain":
        raise LowbitError(f"parallel.cp_layout: {layout!r} is not one of zigzag, plain")
    if seq_len % cp:
        raise LowbitError(f"sequence length {seq_len} must be divisible by cp = {cp}")
    c = seq_len // cp
    return torch.arange(rank * c, (rank + 1) * c)


SENT = {"bytes": 0}  # what this process's rings put on the wire (the trainer reports and resets it per step)


class _Ring:
    """Send to the next rank of the group, receive from the previous one."""

    def __init__(self, group):
        self.group = group
        self.n, self.r = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.r + 1) % self.n)
        self.prev = dist.get_global_rank(group, (self.r - 1) % self.n)

    def start(self, tensors: list[torch.Tensor]):
        bufs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in tensors]
        SENT["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        return bufs, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending) -> list[torch.Tensor]:
        bufs, works = pending
        for w in works:
            w.wait()
        return bufs

    def pass_on(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.finish(self.start(tensors))


def _mask(pos_q: torch.Tensor, pos_k: torch.Tensor, causal: bool):
    """Allowed [Lq, Lk] (None: everything), or False when nothing is (the block is skipped). The extremes decide
    whole blocks first, so the plain layout's off-diagonal blocks never build an Lq×Lk mask."""
    if not causal or pos_q.min() >= pos_k.max():
        return None
    if pos_q.max() < pos_k.min():
        return False
    allowed = pos_q[:, None] >= pos_k[None, :]
    return None if allowed.all() else allowed


def _scores(q, k, allowed, scale):
    s = (q @ k.transpose(-1, -2)) * scale
    return s if allowed is None else s.masked_fill(~allowed, float("-inf"))


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, causal: bool):
        ring, scale = _Ring(group), q.shape[-1] ** -0.5
        qf = q.float()
        out = torch.zeros_like(qf)
        lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
        kc, vc = k, v
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            pending = ring.start([kc, vc]) if step < ring.n - 1 else None  # next block in flight meanwhile
            allowed = _mask(positions[ring.r], positions[src], causal)
            if allowed is not False:
                s = _scores(qf, kc.float(), allowed, scale)
                blk_lse = torch.logsumexp(s, -1)
                blk = torch.softmax(s, -1).nan_to_num_(0.0) @ vc.float()  # a row with nothing allowed: 0
                new = torch.logaddexp(lse, blk_lse)
                keep = torch.where(new == float("-inf"), 0.0, torch.exp(lse - new))
                take = torch.where(new == float("-inf"), 0.0, torch.exp(blk_lse - new))
                out = out * keep[..., None] + blk * take[..., None]
                lse = new
            if pending is not None:
                kc, vc = ring.finish(pending)
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.group, ctx.causal = group, causal
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), q.shape[-1] ** -0.5
        qf, do = q.float(), dout.float()
        delta = (do * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        kc, vc = k, v
        dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            pending = ring.start([kc, vc]) if step < ring.n - 1 else None
            allowed = _mask(positions[ring.r], positions[src], ctx.causal)
            if allowed is not False:
                kf, vf = kc.float(), vc.float()
                p = torch.exp(_scores(qf, kf, allowed, scale) - lse[..., None]).nan_to_num_(0.0)
                dv += p.transpose(-1, -2) @ do
                ds = p * (do @ vf.transpose(-1, -2) - delta)
                dq += (ds @ kf) * scale
                dk += (ds.transpose(-1, -2) @ qf) * scale
            dk, dv = ring.pass_on([dk, dv])  # accumulators travel with their block; after n hops they are home
            if pending is not None:
                kc, vc = ring.finish(pending)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class RingSelfAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, positions, group, causal: bool):
        ring, scale = _Ring(group), q.shape[-1] ** -0.5
        qf = q.float()
        # stage one: keys circulate; each query slice assembles its full score rows [Lq, L] (blocks by source)
        blocks, kc = [None] * ring.n, k
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            allowed = _mask(positions[ring.r], positions[src], causal)
            blocks[src] = (qf.new_full((*qf.shape[:-1], kc.shape[-2]), float("-inf")) if allowed is False
                           else _scores(qf, kc.float(), allowed, scale))
            if step < ring.n - 1:
                kc = ring.pass_on([kc])[0]
        p = torch.softmax(torch.cat(blocks, -1), -1)
        # stage two: values circulate; out = Σ_src P[:, src block] V_src
        lk, out, vc = k.shape[-2], torch.zeros_like(qf), v
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            out += p[..., src * lk:(src + 1) * lk] @ vc.float()
            if step < ring.n - 1:
                vc = ring.pass_on([vc])[0]
        ctx.save_for_backward(q, k, v, p)
        ctx.group = group
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p = ctx.saved_tensors
        ring, scale = _Ring(ctx.group), q.shape[-1] ** -0.5
        qf, do, lk = q.float(), dout.float(), k.shape[-2]
        # values circulate again with their dV accumulators: dP rows are assembled, dV goes home
        dp = torch.empty_like(p)
        vc, dv = v, torch.zeros_like(v, dtype=torch.float32)
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            sl = slice(src * lk, (src + 1) * lk)
            dp[..., sl] = do @ vc.float().transpose(-1, -2)
            dv += p[..., sl].transpose(-1, -2) @ do
            vc, dv = ring.pass_on([vc, dv]) if step < ring.n - 1 else (vc, ring.pass_on([dv])[0])
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        # keys circulate with their dK accumulators
        kc, dk, dq = k, torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(qf)
        for step in range(ring.n):
            src = (ring.r - step) % ring.n
            sl = slice(src * lk, (src + 1) * lk)
            dq += (ds[..., sl] @ kc.float()) * scale
            dk += (ds[..., sl].transpose(-1, -2) @ qf) * scale
            kc, dk = ring.pass_on([kc, dk]) if step < ring.n - 1 else (kc, ring.pass_on([dk])[0])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class ContextParallelAttention(nn.Module):
    """The attention core of a context-parallel model: this rank's queries against everyone's keys/values."""

    def __init__(self, group, seq_len: int, impl: str = "ring", causal: bool = True, layout: str = "zigzag"):
        super().__init__()
        if impl not in ("ring", "rsa"):
            raise LowbitError(f"parallel.cp_impl: {impl!r} is not one of ring, rsa")
        self.group, self.impl, self.causal = group, impl, causal
        n = dist.get_world_size(group)
        self.register_buffer("positions", torch.stack([shard_positions(seq_len, n, r, layout) for r in range(n)]),
                             persistent=False)

    def forward(self, q, k, v, positions=None):
        fn = RingAttention if self.impl == "ring" else RingSelfAttention
        return fn.apply(q, k, v, self.positions, self.group, self.causal)


def apply_context_parallel(model: nn.Module, group, seq_len: int, impl: str, layout: str = "zigzag") -> None:
    """Swap every attention core of a built Llama for the context-parallel one."""
    for m in model.modules():
        if hasattr(m, "core") and hasattr(m, "wq"):
            m.core = ContextParallelAttention(group, seq_len, impl, layout=layout).to(m.wq.weight.device)
