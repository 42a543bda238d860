"""The block schedule of context-parallel attention: which (query, key) sub-blocks of a rank's shard against a
source rank's shard to run through the fused kernel (attention_block.py), how partial outputs merge by their
log-sum-exp, and the backward of one step given the global output and log-sum-exp.

A shard's positions are cut into stretches of consecutive positions (zigzag: two chunks, plain: one). Under the
causal mask a pair of stretches is then fully allowed (every query after every key: one kernel call without a
mask), fully masked (skipped), or the same positions on both sides (the diagonal: one causal call on a square).
Stretches that overlap only in part are cut at each other's ends first, so no call ever needs an Lq×Lk mask.
Calls that share a key (or query) range and touch on the other side are joined, so a zigzag rank runs one call per
off-diagonal block and its own block as one causal call (its positions increase along the shard).

`OneDeviceRing` runs this same schedule for every rank of a simulated ring on one device, over the cp shards of
one sequence, with no process group: the check, on one GPU, that the schedule equals attention over the whole
sequence, and the timing and memory of the blocks that a cp rank runs.
"""

from __future__ import annotations

import functools

import torch

from lowbit.distributed.attention_block import block_backward, block_forward


def _stretches(pos: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive positions as (local start, first position, length)."""
    runs, start = [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            runs.append((start, pos[start], i - start))
            start = i
    return runs


def _cut(run: tuple[int, int, int], at: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """A run split wherever a position in `at` falls strictly inside it."""
    local, first, n = run
    edges = sorted({first, first + n, *(p for p in at if first < p < first + n)})
    return [(local + a - first, a, b - a) for a, b in zip(edges, edges[1:])]


def _pairs(qrun, krun) -> list[tuple[int, int, int, int, bool]]:
    qs = _cut(qrun, (krun[1], krun[1] + krun[2]))
    ks = _cut(krun, (qrun[1], qrun[1] + qrun[2]))
    calls = []
    for ql, qp, qn in qs:
        for kl, kp, kn in ks:
            if (qp, qn) == (kp, kn):
                calls.append((ql, ql + qn, kl, kl + kn, True))
            elif qp >= kp + kn:  # disjoint pieces: every query comes after every key
                calls.append((ql, ql + qn, kl, kl + kn, False))
    return calls


def _join(calls: list) -> list:
    """Unmasked calls on the same key range with touching query ranges (or the reverse) become one call."""
    calls = sorted(calls)
    joined = True
    while joined:
        joined = False
        for i, a in enumerate(calls):
            for j, b in enumerate(calls):
                if i == j or a[4] or b[4]:
                    continue
                if a[2:4] == b[2:4] and a[1] == b[0]:
                    calls[i] = (a[0], b[1], a[2], a[3], False)
                elif a[0:2] == b[0:2] and a[3] == b[2]:
                    calls[i] = (a[0], a[1], a[2], b[3], False)
                else:
                    continue
                del calls[j]
                joined = True
                break
            if joined:
                break
    return calls


@functools.lru_cache(maxsize=4096)
def block_plan(pos_q: tuple[int, ...], pos_k: tuple[int, ...], causal: bool) -> tuple:
    """The kernel calls (q start, q end, k start, k end, causal) of one shard's queries against one shard's keys."""
    if not causal:
        return ((0, len(pos_q), 0, len(pos_k), False),)
    if pos_q == pos_k and all(b > a for a, b in zip(pos_q, pos_q[1:])):
        return ((0, len(pos_q), 0, len(pos_k), True),)  # increasing positions: position order is index order
    calls = [c for a in _stretches(pos_q) for b in _stretches(pos_k) for c in _pairs(a, b)]
    return tuple(_join(calls))


def fresh_accumulators(q: torch.Tensor):
    """An fp32 output of zeros and a log-sum-exp of −inf for q's rows: the merge's starting point."""
    return (torch.zeros(q.shape, dtype=torch.float32, device=q.device),
            torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device))


def merge(out: torch.Tensor, lse: torch.Tensor, blk: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold a block's normalized output into the running one, in place, in fp32: the new block's share of the
    merged row is exp(blk_lse − new_lse) = sigmoid(blk_lse − lse) (1 where nothing was merged yet)."""
    share = torch.sigmoid(blk_lse - lse).unsqueeze(-1)
    out.add_((blk.float() - out).mul_(share))
    torch.logaddexp(lse, blk_lse, out=lse)


def forward_step(q, k, v, plan, scale: float, out, lse) -> None:
    """One ring step: this shard's queries against one source shard's K/V, merged into (out, lse)."""
    for q0, q1, k0, k1, causal in plan:
        blk, blk_lse = block_forward(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :], causal, scale)
        merge(out[..., q0:q1, :], lse[..., q0:q1], blk, blk_lse)


def backward_step(dout, q, k, v, out, lse, plan, scale: float, dq):
    """One ring step of the backward: dq accumulated in place (fp32); the source shard's (dk, dv) in fp32."""
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for q0, q1, k0, k1, causal in plan:
        gq, gk, gv = block_backward(dout[..., q0:q1, :], q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :],
                                    out[..., q0:q1, :], lse[..., q0:q1], causal, scale)
        dq[..., q0:q1, :] += gq
        dk[..., k0:k1, :] += gk
        dv[..., k0:k1, :] += gv
    return dk, dv


class OneDeviceRing(torch.autograd.Function):
    """Attention over a whole sequence [B, H, L, D] computed as a cp-rank ring would: rank r's shard
    (positions[r]) against every rank's shard in ring order, merged by log-sum-exp; backward the same way.
    Keeps for backward what a ring rank keeps (q, k, v, the output, the log-sum-exp), for all ranks together."""

    @staticmethod
    def forward(ctx, q, k, v, positions, causal: bool):
        pos, scale = [tuple(p) for p in positions.tolist()], q.shape[-1] ** -0.5
        idx = [p.to(q.device) for p in positions]
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        for r in range(len(pos)):
            qr = q[:, :, idx[r]]
            o, l = fresh_accumulators(qr)
            for step in range(len(pos)):
                src = (r - step) % len(pos)
                forward_step(qr, k[:, :, idx[src]], v[:, :, idx[src]], block_plan(pos[r], pos[src], causal),
                             scale, o, l)
            out[:, :, idx[r]], lse[:, :, idx[r]] = o.to(q.dtype), l
        ctx.save_for_backward(q, k, v, out, lse, positions)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, positions = ctx.saved_tensors
        pos, scale = [tuple(p) for p in positions.tolist()], q.shape[-1] ** -0.5
        idx = [p.to(q.device) for p in positions]
        dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (q, k, v))
        for r in range(len(pos)):
            rows = (dout[:, :, idx[r]], q[:, :, idx[r]])
            o, l, dqr = out[:, :, idx[r]], lse[:, :, idx[r]], torch.zeros_like(dq[:, :, idx[r]])
            for step in range(len(pos)):
                src = (r - step) % len(pos)
                gk, gv = backward_step(*rows, k[:, :, idx[src]], v[:, :, idx[src]], o, l,
                                       block_plan(pos[r], pos[src], ctx.causal), scale, dqr)
                dk.index_add_(2, idx[src], gk)
                dv.index_add_(2, idx[src], gv)
            dq[:, :, idx[r]] = dqr
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None
