"""Bounded scales for the optimizer's scaled states: the update in one pass over memory.

MS-AMP's update takes each scaled state's new scale from the new state's amax, so it computes every new state
twice (two passes: the amaxes, then the writes), moving about 1.5x the bytes the update must. A scale only has
to keep the new values inside the format's range, and a bound of the new amax gives one from scalars alone: the
amax each state had when it was last written (recorded as it is written), the gradient's scale and the step's
hyper-parameters (`bounds`). The bound's scale is never above the amax's, at most a power of two or two below it
in practice: FP16 states keep the same values (their range is 2^40), E4M3 ones lose at most the bottom binade or
two of their range to subnormals. `optim.scales = bound` selects it; docs/numerics.md compares them.

`optim.scales = mixed` keeps the amax's scale for the FP8 states, whose range is short (E4M3: 2^-9..2^8.5), and
the bound's for the FP16 ones, whose stored values a power of two or two of scale leaves as they are unless they
sit among FP16's subnormals, about 2^28-2^30 below the state's largest. Under fp8lm-o2 (E4M3 gradient and first
moment, FP16 second moment and weights) its amax pass reads 2 bytes per parameter where MS-AMP's reads 6: the
first moment's new value needs only the gradient and the old moment.
"""

from __future__ import annotations

import math

import torch

from lowbit.optim.precision import KINDS, decode, pow2_scale


def scaled_states(kinds, m_scale, v_scale, master_scale) -> list[tuple[str, str, torch.Tensor]]:
    """The states stored in scaled kinds, (name, kind, scale) in m, v, w order; `exact_states` are those whose new
    scale comes from their new amax."""
    k_m, k_v, k_master = kinds[:3]
    return [(n, k, s) for n, k, s in (("m", k_m, m_scale), ("v", k_v, v_scale), ("w", k_master, master_scale))
            if k != "none" and KINDS[k][1]]


def from_amax(kind: str, scales: str) -> bool:
    """Whether a scaled state of `kind` takes its new scale from its new amax under `optim.scales`."""
    return scales == "amax" or (scales == "mixed" and KINDS[kind][0].itemsize == 1)


def exact_states(kinds, m_scale, v_scale, master_scale) -> list[tuple[str, str, torch.Tensor]]:
    """scaled_states' states whose new scale comes from their new amax (an amax pass before the writes)."""
    return [s for s in scaled_states(kinds, m_scale, v_scale, master_scale) if from_amax(s[1], kinds[5])]


def merged(item: tuple, kinds, exact, bounded):
    """An item's new scales in scaled_states' order: `exact` (the amaxes' scales, in exact_states' order) for the
    states that take theirs from an amax, `bounded` (bound_scales') for the others; None without scaled states."""
    names = [n for n, _, _ in scaled_states(kinds, *item[5:10:2])]
    if not names or kinds[5] != "mixed":
        return exact if kinds[5] == "amax" else bounded
    ex = [n for n, _, _ in exact_states(kinds, *item[5:10:2])]
    return torch.stack([exact[ex.index(n)] if n in ex else bounded[i] for i, n in enumerate(names)])


def bounds(amax, g_bound, step, lr, wd, beta1: float, beta2: float) -> torch.Tensor:
    """Upper bounds of the new |m|, |v|, |w| (columns) from the last step's amaxes `amax` (..., 3), a bound of the
    gradient's magnitude and the step about to be taken: |m'| <= b1 |m| + (1 - b1) |g|, v' <= b2 v + (1 - b2) g^2,
    and |w'| <= |w| |1 - lr wd| + lr r, where r bounds AdamW's |m^| / sqrt(v^): by Cauchy-Schwarz over the
    gradients m and v sum, |m| / sqrt(v) <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_k<t (b1^2 / b2)^k), times the bias
    corrections' sqrt(1 - b2^t) / (1 - b1^t). That holds in exact arithmetic; rounded states can pass it by a few
    percent, which a factor 2 on r covers (a weight past its bound would saturate, never turn Inf). Elementwise
    over the leading dimensions, so a chunk's bounds are one batch of small ops."""
    t = step + 1
    q = beta1 * beta1 / beta2
    geometric = t if q == 1 else (1 - q ** t) / (1 - q)
    bc1, bc2 = 1 - beta1 ** t, torch.sqrt(1 - beta2 ** t)
    r = 2 * (1 - beta1) / math.sqrt(1 - beta2) * torch.sqrt(geometric) * bc2 / bc1
    m = beta1 * amax[..., 0] + (1 - beta1) * g_bound
    v = beta2 * amax[..., 1] + (1 - beta2) * g_bound * g_bound
    w = amax[..., 2] * abs(1 - lr * wd) + lr * r
    return torch.stack([m, v, w], dim=-1)


def grad_bound(g, g_scale, g_kind: str) -> torch.Tensor:
    """A bound of a stored gradient's magnitude: a scaled kind's data is clamped to its range, so fmax / scale
    (no pass over it); an unscaled kind's amax."""
    return KINDS[g_kind][2] / g_scale if KINDS[g_kind][1] else g.abs().amax().float()


def bound_table(items: list[tuple], lr, beta1: float, beta2: float, kinds) -> torch.Tensor:
    """The new scales of a chunk's states from `bounds`, (items, 3) for m, v, w (a column of a state not stored in
    a scaled kind is meaningless): the scale of a bound is never above the amax's, so nothing written overflows.
    A chunk shares one weight decay (adamw._chunks); eager, a few small ops for the whole chunk."""
    b = bounds(torch.stack([it[13] for it in items]), torch.stack([grad_bound(*it[1:4]) for it in items]),
               torch.stack([it[10] for it in items]), lr, items[0][11], beta1, beta2)
    old = [torch.stack([it[i] for it in items]) for i in (5, 7, 9)]
    return torch.stack([pow2_scale(b[:, c], KINDS[k][2] if k != "none" else 1.0, old[c])
                        for c, k in enumerate(kinds[:3])], dim=1)


def bound_scales(items: list[tuple], lr, beta1: float, beta2: float, kinds) -> list:
    """bound_table's scales per item, those of its scaled states stacked in scaled_states' order (or None)."""
    cols = ["mvw".index(n) for n, _, _ in scaled_states(kinds, *items[0][5:10:2])]
    if not cols:
        return [None] * len(items)
    table = bound_table(items, lr, beta1, beta2, kinds)
    return [torch.stack([table[i, c] for c in cols]) for i in range(len(items))]


def stored_amaxes(kinds, m, m_scale, v, v_scale, master, master_scale) -> torch.Tensor:
    """The amaxes of stored m, v and master (0 for one not stored in a scaled kind), (3,): what `bounds` starts
    from. Elementwise in the tensors, so slices give a piece of the whole's (their maximum)."""
    out = torch.zeros(3, device=m.device)
    for n, k, s in scaled_states(kinds, m_scale, v_scale, master_scale):
        data = {"m": m, "v": v, "w": master}[n]
        out["mvw".index(n)] = decode(data, k, s).abs().amax()
    return out
