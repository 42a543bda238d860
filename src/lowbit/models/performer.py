"""Performer attention (Choromanski et al. 2021, FAVOR+): softmax attention estimated with positive orthogonal
random features and computed K·V first, so time and memory grow linearly with sequence length.

    exp(q·k/√d) ≈ φ(q)·φ(k),   φ(x) = exp(Wx' − ‖x'‖²/2)/√M,   x' = x/d^¼,

with the M rows of W orthogonal in blocks of d and scaled to chi(d) norms. Attention is then
φ(Q)(φ(K)ᵀ[V 1]) split into numerator and normalizer. Causal attention is the same with prefix sums over
positions, computed chunk by chunk with a hand-written backward: only the running M×(D+1) state and one group of
chunks are live at a time, never an L×M×D tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lowbit.errors import LowbitError


def default_features(head_dim: int) -> int:
    """M = d·ln d, the paper's O(d log d) feature count."""
    return max(1, round(head_dim * math.log(head_dim)))


def orthogonal_features(m: int, d: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """[m, d] random projection: blocks of d orthonormal rows (QR of a Gaussian), each row rescaled to the norm of
    an independent d-dimensional Gaussian vector, so every row is marginally N(0, I) and rows within a block are
    exactly orthogonal. Drawn on the CPU in fp64 (same values on every device), returned in fp32."""
    blocks = []
    for _ in range(math.ceil(m / d)):
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64, device="cpu"))
        blocks.append(q.t())
    norms = torch.randn(m, d, generator=generator, dtype=torch.float64, device="cpu").norm(dim=1, keepdim=True)
    return (torch.cat(blocks)[:m] * norms).float()


class _FeatureMap(torch.autograd.Function):
    """φ(x) = exp(Wx' − ‖x'‖²/2 − shift), computed in fp32 (fp64 for fp64 x) and returned in x's dtype. Backward
    keeps only x' and φ: ∂φ_m/∂x' = φ_m (w_m − x'), so dx' = (g∘φ) W − (Σ_m g_m φ_m) x'."""

    @staticmethod
    def forward(ctx, x, w, is_query: bool):
        acc = torch.promote_types(x.dtype, torch.float32)
        xs = x.to(acc) * x.shape[-1] ** -0.25
        w = w.to(acc)
        # one GEMM gives Wx' − ‖x'‖²/2: x' gets ‖x'‖² as an extra column, W a column of −1/2
        logits = torch.cat([xs, xs.pow(2).sum(-1, keepdim=True)], -1) @ torch.cat([w, w.new_full((len(w), 1), -0.5)],
                                                                                   -1).t()
        shift = logits.amax(-1, keepdim=True) if is_query else logits.amax((-2, -1), keepdim=True)
        phi = logits.sub_(shift).exp_().to(x.dtype)
        ctx.save_for_backward(xs, w, phi)
        return phi

    @staticmethod
    def backward(ctx, g):
        xs, w, phi = ctx.saved_tensors
        gp = g.to(xs.dtype) * phi.to(xs.dtype)
        dxs = gp @ w - gp.sum(-1, keepdim=True) * xs
        return (dxs * xs.shape[-1] ** -0.25).to(g.dtype), None, None


def feature_map(x: torch.Tensor, w: torch.Tensor, is_query: bool) -> torch.Tensor:
    """φ(x) for x [..., L, d] and w [M, d], in x's dtype, up to a constant factor: the largest exponent is subtracted
    before exp (per row for queries, over the whole sequence for keys) and the 1/√M is left out. Both are the same
    factor in every term of a query's numerator and normalizer, so they cancel exactly and carry no gradient."""
    return _FeatureMap.apply(x, w, is_query)


GROUP = 8192  # positions per step of the causal sweep: its chunks run as one batched product (few GPU launches)


def _chunks(t: torch.Tensor, c: int) -> torch.Tensor:
    return t.unflatten(-2, (-1, c))  # [..., n, X] -> [..., n/c, c, X]


def _exclusive_cumsum(x: torch.Tensor, reverse: bool = False) -> torch.Tensor:
    """Σ over the chunks before (after, with reverse) each chunk along dim -3, without the chunk itself."""
    if reverse:
        return _exclusive_cumsum(x.flip(-3)).flip(-3)
    return torch.cat([torch.zeros_like(x[..., :1, :, :]), x[..., :-1, :, :].cumsum(-3)], dim=-3)


class CausalLinearAttention(torch.autograd.Function):
    """out_i = Σ_{j≤i} (q_i·k_j) v_j for q, k [B, H, L, M] and v [B, H, L, E].

    Positions are split into chunks of `chunk`: within a chunk, the masked chunk×chunk scores; across chunks, the
    running state S = Σ_{j in earlier chunks} k_j v_jᵀ (M×E). The sweep takes GROUP positions per step, their chunks
    batched, so live memory is the state plus one group whatever L. Backward sweeps the groups in reverse with
    the suffix state R = Σ_{i in later chunks} q_i g_iᵀ: dk = R v + masked part, dv = Rᵀ k + masked part, and
    dq = g Sᵀ + masked part from the group's starting S, saved in forward (one M×E per group).

    Products run in the dtype of q, k, v (bf16 under autocast); the states accumulate in fp32 (or fp64)."""

    @staticmethod
    def forward(ctx, q, k, v, chunk: int):
        n = q.shape[-2]
        c = min(chunk, n)
        if n % c:  # zero rows add nothing to any sum and are cut from the output
            q, k, v = (F.pad(t, (0, 0, 0, c - n % c)) for t in (q, k, v))
        step = max(1, GROUP // c) * c
        acc = torch.promote_types(q.dtype, torch.float32)
        state = q.new_zeros(*q.shape[:-2], q.shape[-1], v.shape[-1], dtype=acc)
        out, starts = torch.empty_like(v), []
        for s in range(0, q.shape[-2], step):
            qg, kg, vg = (_chunks(t[..., s:s + step, :], c) for t in (q, k, v))
            starts.append(state)
            kv = (kg.transpose(-1, -2) @ vg).to(acc)
            before = _exclusive_cumsum(kv) + state.unsqueeze(-3)
            o = qg @ before.to(q.dtype) + (qg @ kg.transpose(-1, -2)).tril_() @ vg
            out[..., s:s + step, :] = o.flatten(-3, -2)
            state = before[..., -1, :, :] + kv[..., -1, :, :]
        ctx.chunk, ctx.n = c, n
        ctx.save_for_backward(q, k, v, torch.stack(starts))
        return out[..., :n, :]

    @staticmethod
    def backward(ctx, g):
        q, k, v, starts = ctx.saved_tensors
        c, n, total = ctx.chunk, ctx.n, q.shape[-2]
        g = F.pad(g, (0, 0, 0, total - n)) if total > n else g.contiguous()
        step = max(1, GROUP // c) * c
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        after = torch.zeros_like(starts[0])  # R for the last group: nothing comes after it
        for i, s in reversed(list(enumerate(range(0, total, step)))):
            qg, kg, vg, gg = (_chunks(t[..., s:s + step, :], c) for t in (q, k, v, g))
            before = _exclusive_cumsum((kg.transpose(-1, -2) @ vg).to(after.dtype)) + starts[i].unsqueeze(-3)
            qgt = (qg.transpose(-1, -2) @ gg).to(after.dtype)
            later = _exclusive_cumsum(qgt, reverse=True) + after.unsqueeze(-3)
            a = (qg @ kg.transpose(-1, -2)).tril_()  # a[i, j] = q_i·k_j, j ≤ i
            b = (gg @ vg.transpose(-1, -2)).tril_()  # b[i, j] = g_i·v_j, j ≤ i
            dq[..., s:s + step, :] = (gg @ before.transpose(-1, -2).to(q.dtype) + b @ kg).flatten(-3, -2)
            dk[..., s:s + step, :] = (b.transpose(-1, -2) @ qg + vg @ later.transpose(-1, -2).to(q.dtype)
                                      ).flatten(-3, -2)
            dv[..., s:s + step, :] = (a.transpose(-1, -2) @ gg + kg @ later.to(q.dtype)).flatten(-3, -2)
            after = later[..., 0, :, :] + qgt[..., 0, :, :]
        return dq[..., :n, :], dk[..., :n, :], dv[..., :n, :], None


def favor_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, causal: bool = True,
                    chunk: int = 256) -> torch.Tensor:
    """FAVOR+ attention of q [B, H, L, d] over k, v [B, H, L, d] (k, v already repeated for GQA) with features
    w [M, d]. The feature map runs in fp32 (fp64 for fp64 inputs): the exponentials need its range; the products
    in the inputs' dtype; the result is in the inputs' dtype."""
    if chunk <= 0:
        raise LowbitError(f"performer chunk size must be > 0, got {chunk}")
    acc = torch.promote_types(q.dtype, torch.float32)
    fq, fk = feature_map(q, w, True), feature_map(k, w, False)
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)  # last column accumulates the normalizer
    if causal:
        out = CausalLinearAttention.apply(fq, fk, v1, chunk)
    else:
        out = fq @ (fk.transpose(-1, -2) @ v1)
    out = out.to(acc)
    # Every feature is positive, so the normalizer is > 0 unless it underflowed; the floor keeps 0/0 out.
    return (out[..., :-1] / out[..., -1:].clamp_min(torch.finfo(acc).tiny)).to(q.dtype)


class Performer(nn.Module):
    """Causal FAVOR+ attention with its random features as a buffer: saved in checkpoints, redrawn by the
    trainer every `redraw` steps (`redraw_features`)."""

    def __init__(self, head_dim: int, features: int, chunk: int):
        super().__init__()
        if features <= 0:
            raise LowbitError(f"model.performer_features: must be > 0, got {features}")
        if chunk <= 0:
            raise LowbitError(f"model.performer_chunk: must be > 0, got {chunk}")
        self.chunk = chunk
        # A private generator: building the module leaves the global RNG (weight init) alone; Llama redraws.
        self.register_buffer("features", orthogonal_features(features, head_dim, torch.Generator().manual_seed(0)))

    def redraw(self, generator: torch.Generator | None = None) -> None:
        m, d = self.features.shape
        self.features.copy_(orthogonal_features(m, d, generator))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions=None) -> torch.Tensor:
        # Autocast off: favor_attention picks its own precisions (fp32 features and sums, products in q's dtype).
        with torch.autocast(q.device.type, enabled=False):
            return favor_attention(q, k, v, self.features, causal=True, chunk=self.chunk)


def redraw_features(model: nn.Module, seed: int) -> int:
    """Redraw every Performer's features from one generator seeded with `seed` (layers in module order);
    returns how many were redrawn."""
    g = torch.Generator().manual_seed(seed)
    layers = [m for m in model.modules() if isinstance(m, Performer)]
    for m in layers:
        m.redraw(g)
    return len(layers)
