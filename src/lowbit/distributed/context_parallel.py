"""Context (sequence) parallelism: each of cp ranks holds a slice of every sequence; attention circulates K/V
around a ring of point-to-point transfers (batch_isend_irecv), so no rank ever holds the whole sequence's K/V.

The split (parallel.cp_layout): zigzag, for causal load balance, cuts the sequence into 2·cp chunks and rank r
holds chunks r and 2·cp−1−r, so every rank has as many unmasked query-key pairs; plain gives rank r the contiguous
chunk r, so its queries see the K/V of ranks 0..r only: the later blocks are fully masked and skipped (the last
rank computes cp blocks, the first one). Positions travel with the shards: RoPE uses them and the block schedule
(ring_blocks.block_plan) compares them.

    ring  each arriving K/V block goes through a fused attention kernel that returns its log-sum-exp (flash on CUDA
          and CPU, attention_block.py), partial outputs merged by log-sum-exp in fp32 (ring_blocks.py); the next
          block is in flight while this one is computed. Backward runs the ring again, each block's kernel
          backward given the global output and log-sum-exp; dK/dV accumulators (fp32) travel with their block and
          are home after a full turn. Kept for backward: q, k, v, the output and the log-sum-exp, nothing Lq×Lk.
    rsa   the sequence-parallelism paper's ring self-attention: stage one circulates the keys, stage two the
          values. Blockwise: stage one assembles the key blocks (L×D, for this layer's call only) instead of the
          Lq×L score rows, stage two runs each arriving value block with its keys through the same kernel and
          merge. Backward assembles the keys again, then circulates the values with their dK/dV accumulators.

Both move K/V with the model's n_kv_heads heads (GQA: the core is `grouped_kv`), repeated to the query heads only
for each kernel call; each block's dK/dV share is summed over the group before it travels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowbit.distributed.kv_wire import KVWire
from lowbit.distributed.ring_blocks import (OneDeviceRing, backward_step, block_plan, forward_step,
                                           fresh_accumulators)
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
        return bufs, dist.batch_isend_irecv(ops), ops  # the ops hold the sent tensors until the transfer is done

    @staticmethod
    def finish(pending) -> list[torch.Tensor]:
        bufs, works, _ = pending
        for w in works:
            w.wait()
        return bufs

    def pass_on(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.finish(self.start(tensors))


def expand_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """K/V [B, Hkv, L, D] repeated to the query heads as the model's GQA does (repeat_interleave: head j serves
    query heads j·rep .. j·rep+rep−1), for the kernel call only: the ring moves the Hkv heads."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=1)


def fold_heads(g: torch.Tensor, rep: int) -> torch.Tensor:
    """The gradient of `expand_heads`: [B, H, L, D] summed over each group of rep query heads (in its dtype)."""
    return g if rep == 1 else g.unflatten(1, (g.shape[1] // rep, rep)).sum(2)


def _arrived(ring, pending, kc, keys):
    """The (keys, values) wire payloads of the next step: only the values travel when `keys` are assembled."""
    got = ring.finish(pending)
    return (kc, got) if keys is not None else (got[:len(kc)], got[len(kc):])


def _ring_forward(ring, q, k, v, pos, causal: bool, wire: KVWire, keys=None):
    """This rank's queries against every rank's K/V, one block per step, the next block in flight meanwhile;
    with `keys` (RSA's second stage) the keys are already here and only the values travel. K/V travel with their
    own (GQA) head count, packed by `wire`, and are unpacked and repeated to q's heads per kernel call."""
    scale, rep = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
    out, lse = fresh_accumulators(q)
    kc, vc = wire.pack(k), wire.pack(v)
    for step in range(ring.n):
        src = (ring.r - step) % ring.n
        pending = ring.start(vc if keys is not None else kc + vc) if step < ring.n - 1 else None
        kb = keys[src] if keys is not None else wire.unpack(kc, k)
        forward_step(q, expand_heads(kb, rep), expand_heads(wire.unpack(vc, v), rep),
                     block_plan(pos[ring.r], pos[src], causal), scale, out, lse)
        if pending is not None:
            kc, vc = _arrived(ring, pending, kc, keys)
    return out.to(q.dtype), lse


def _ring_backward(ring, dout, q, k, v, out, lse, pos, causal: bool, wire: KVWire, keys=None):
    """The ring again, each block's kernel backward given the global output and log-sum-exp: dq adds up here,
    each block's (dk, dv) travels on with it, gaining every rank's share, and is home after a full turn. A block's
    share is computed before the accumulator from the previous rank is awaited, so that transfer overlaps it.
    Each share is summed over the GQA group (fp32) before it travels: accumulators have K/V's head count."""
    scale, rep = q.shape[-1] ** -0.5, q.shape[1] // k.shape[1]
    dout = dout.contiguous()
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kc, vc, acc = wire.pack(k), wire.pack(v), None
    for step in range(ring.n):
        src = (ring.r - step) % ring.n
        pending = ring.start(vc if keys is not None else kc + vc) if step < ring.n - 1 else None
        kb = keys[src] if keys is not None else wire.unpack(kc, k)
        dk, dv = backward_step(dout, q, expand_heads(kb, rep), expand_heads(wire.unpack(vc, v), rep), out, lse,
                               block_plan(pos[ring.r], pos[src], causal), scale, dq)
        dk, dv = fold_heads(dk, rep), fold_heads(dv, rep)
        if acc is not None:
            dk_in, dv_in = ring.finish(acc)
            dk += dk_in
            dv += dv_in
        acc = ring.start([dk, dv])
        if pending is not None:
            kc, vc = _arrived(ring, pending, kc, keys)
    dk, dv = ring.finish(acc)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _host_positions(positions: torch.Tensor) -> list[tuple[int, ...]]:
    return [tuple(p) for p in positions.tolist()]


class RingAttention(torch.autograd.Function):
    """(q, k, v, positions, group, causal, wire): `wire` (kv_wire.KVWire, exact when left out) says how K/V
    travel; under fp8 every block is computed with the dequantized K/V, this rank's own too."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, causal: bool, wire: KVWire | None = None):
        ring, pos, wire = _Ring(group), _host_positions(positions), wire or KVWire()
        out, lse = _ring_forward(ring, q, k, v, pos, causal, wire)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.pos, ctx.wire = group, causal, pos, wire
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        grads = _ring_backward(_Ring(ctx.group), dout, q, k, v, out, lse, ctx.pos, ctx.causal, ctx.wire)
        return *grads, None, None, None, None


def _assemble_keys(ring, k, wire: KVWire) -> list[torch.Tensor]:
    """RSA's first stage: the keys go once around the ring; every rank keeps each block (L×D, not Lq×L scores),
    unpacked (dequantized under fp8)."""
    keys, kc = [None] * ring.n, wire.pack(k)
    for step in range(ring.n):
        keys[(ring.r - step) % ring.n] = wire.unpack(kc, k)
        if step < ring.n - 1:
            kc = ring.pass_on(kc)
    return keys


class RingSelfAttention(torch.autograd.Function):
    """As RingAttention, in RSA's two stages."""

    @staticmethod
    def forward(ctx, q, k, v, positions, group, causal: bool, wire: KVWire | None = None):
        ring, pos, wire = _Ring(group), _host_positions(positions), wire or KVWire()
        out, lse = _ring_forward(ring, q, k, v, pos, causal, wire, keys=_assemble_keys(ring, k, wire))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.pos, ctx.wire = group, causal, pos, wire
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, wire = _Ring(ctx.group), ctx.wire
        grads = _ring_backward(ring, dout, q, k, v, out, lse, ctx.pos, ctx.causal, wire,
                               keys=_assemble_keys(ring, k, wire))
        return *grads, None, None, None, None


class ContextParallelAttention(nn.Module):
    """The attention core of a context-parallel model: this rank's queries against everyone's keys/values.
    `grouped_kv`: the model hands K/V with their own head count, which is what travels (n_heads/n_kv_heads times
    fewer bytes than repeated K/V); they are repeated locally for each kernel call."""

    grouped_kv = True

    def __init__(self, group, seq_len: int, impl: str = "ring", causal: bool = True, layout: str = "zigzag",
                 kv_dtype: str = "auto"):
        super().__init__()
        self.wire = KVWire(kv_dtype)  # how K/V travel: parallel.cp_kv_dtype
        if impl not in ("ring", "rsa"):
            raise LowbitError(f"parallel.cp_impl: {impl!r} is not one of ring, rsa")
        self.group, self.impl, self.causal = group, impl, causal
        n = dist.get_world_size(group)
        # on the host, not a buffer: the block schedule is decided from them in Python, with no device sync
        self.positions = torch.stack([shard_positions(seq_len, n, r, layout) for r in range(n)])

    def forward(self, q, k, v, positions=None):
        fn = RingAttention if self.impl == "ring" else RingSelfAttention
        return fn.apply(q, k, v, self.positions, self.group, self.causal, self.wire)


def apply_context_parallel(model: nn.Module, group, seq_len: int, impl: str, layout: str = "zigzag",
                           kv_dtype: str = "auto") -> None:
    """Swap every attention core of a built Llama for the context-parallel one."""
    for m in model.modules():
        if hasattr(m, "core") and hasattr(m, "wq"):
            m.core = ContextParallelAttention(group, seq_len, impl, layout=layout,
                                              kv_dtype=kv_dtype).to(m.wq.weight.device)


class OneDeviceRingCore(nn.Module):
    """An attention core [B, H, L, D] that runs the block schedule of a cp-rank ring on this one device
    (ring_blocks.OneDeviceRing): a model that measures, on one GPU, what its context-parallel ranks compute."""

    def __init__(self, cp: int, seq_len: int, layout: str = "zigzag", causal: bool = True):
        super().__init__()
        self.causal = causal
        self.positions = torch.stack([shard_positions(seq_len, cp, r, layout) for r in range(cp)])

    def forward(self, q, k, v, positions=None):
        return OneDeviceRing.apply(q, k, v, self.positions, self.causal)
