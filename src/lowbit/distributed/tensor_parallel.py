"""Tensor parallelism (Megatron-LM): each of tp ranks holds 1/tp of every block's attention heads and MLP width.

    column-parallel  wq, wk, wv, w1, w3: output features split; the input is whole on every rank, so backward
                     all-reduces its gradient (`_CopyToTP`)
    row-parallel     wo, w2: input features split; forward all-reduces the partial outputs (`_ReduceFromTP`)

Embeddings, norms and the output head stay whole (replicated, with equal gradients on every tp rank). Applied to a
built, converted model by renaming nothing: the linears keep their names and get their shard and two hooks.

Low precision: a shard must be cast as the whole tensor would be. Where a scaling group (the tensor, or a row split
along the reduction dimension) spans the shards, its amax is all-reduced (MAX) over the tp group, so every rank
uses the scale of the whole tensor: the weight of every split linear and the gradient of column-parallel outputs
and the inputs of row-parallel linears, at tensor granularity, and the rows that a split cuts at row granularity.
Blocks (block, mx) are never cut when the shard width is a multiple of the block: nothing to reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowbit.errors import LowbitError
from lowbit.numerics.linear import LowPrecisionLinear, in_backward

# What this process's tensor-parallel collectives send (a ring all-reduce sends 2(n-1)/n of its tensor, an all-gather
# (n-1) chunks). Counted by the module hooks, outside the autograd Functions, the backward's collectives included,
# when the forward runs: a Python side effect inside a Function breaks torch.compile's graph (9 breaks per step
# at tp2 when the Functions counted), one in a hook is replayed by the compiled code. "A backward follows" is
# judged at forward time (grad enabled, the input requires grad): true on every training path lowbit runs (eval and
# generate run under no_grad). Eagerly, a forward replayed by lowbit's (non-reentrant) activation checkpointing
# counts its collectives again, not the backward's; compiled, the replay runs no Python and counts nothing. Under a
# reentrant checkpoint (not lowbit's) the backward's collectives go uncounted. The amax all-reduces of FP8 scales
# (a few bytes each) are not counted.
SENT = {"bytes": 0}


def _ring_bytes(x: torch.Tensor, group) -> int:
    n = dist.get_world_size(group)
    return 2 * (n - 1) * x.numel() * x.element_size() // n


def _gather_bytes(x: torch.Tensor, group, element_size: int | None = None) -> int:
    return (dist.get_world_size(group) - 1) * x.numel() * (element_size or x.element_size())


def _backward_follows(x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and x.requires_grad and not in_backward()


def _all_reduce(x: torch.Tensor, group) -> None:
    dist.all_reduce(x, group=group)


COLUMN = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROW = ("attention.wo", "feed_forward.w2")


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        _all_reduce(g, ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        _all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def _copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    if _backward_follows(x):
        SENT["bytes"] += _ring_bytes(x, group)  # backward all-reduces x's gradient
    return _CopyToTP.apply(x, group)


def _reduce_from_tp(out: torch.Tensor, group) -> torch.Tensor:
    SENT["bytes"] += _ring_bytes(out, group)
    return _ReduceFromTP.apply(out, group)


def _shard(linear: nn.Linear, dim: int, tp: int, rank: int) -> None:
    w = linear.weight
    if w.shape[dim] % tp:
        raise LowbitError(f"parallel.tp: a linear of shape {tuple(w.shape)} cannot be split {tp} ways")
    linear.weight = nn.Parameter(w.detach().chunk(tp, dim)[rank].clone(), requires_grad=w.requires_grad)
    linear.weight._lowbit_tp_dim = dim  # checkpoints name it a shard along it; clipping sums its norm over tp
    linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]


def _amax_groups(layer: LowPrecisionLinear, column: bool, group) -> None:
    """Which of the layer's operands have scaling groups that span the shards (see the module docstring)."""
    r = layer.recipe
    for operand, spec in (("input", r.input), ("weight", r.weight), ("grad_output", r.grad_output)):
        g = spec.granularity
        if g in ("block", "mx"):
            width = layer.weight.shape[1] if not column else layer.weight.shape[0]
            if width % spec.group[1]:
                raise LowbitError(f"parallel.tp: shard width {width} is not a multiple of the {g} size "
                                  f"{spec.group[1]}")
            continue
        if g == "column":
            raise LowbitError("parallel.tp: column-granularity scaling is not supported with tensor parallelism")
        split = {("input", True): False, ("weight", True): g == "tensor", ("grad_output", True): True,
                 ("input", False): True, ("weight", False): True, ("grad_output", False): False}[operand, column]
        layer.scaling[operand].amax_group = group if split else None


def apply_tensor_parallel(model: nn.Module, group) -> None:
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, m in model.named_modules():
        column, row = name.endswith(COLUMN), name.endswith(ROW)
        if not (column or row):
            continue
        _shard(m, 0 if column else 1, tp, rank)
        if isinstance(m, LowPrecisionLinear):
            _amax_groups(m, column, group)
        if column:
            m.register_forward_pre_hook(lambda mod, args: (_copy_to_tp(args[0], group), *args[1:]))
        else:
            m.register_forward_hook(lambda mod, args, out: _reduce_from_tp(out, group))
    for m in model.modules():
        if hasattr(m, "n_kv_heads") and hasattr(m, "wq"):
            m.n_heads, m.n_kv_heads = m.n_heads // tp, m.n_kv_heads // tp


def sharded_names(model: nn.Module) -> dict[str, int]:
    """name -> split dim of every tensor-parallel parameter."""
    return {n: p._lowbit_tp_dim for n, p in model.named_parameters() if hasattr(p, "_lowbit_tp_dim")}


# ---- sequence parallelism (Megatron-LM SP): outside the split linears, activations are split along the sequence

def _chunk(x: torch.Tensor, group) -> torch.Tensor:
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n, dim=1)[r].contiguous()


def _all_gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    _all_reduce(x, group)  # gloo has no reduce-scatter: the sum, then this rank's chunk (2x a reduce-scatter)
    return _chunk(x, group)


class _ToChunk(torch.autograd.Function):
    """Whole sequence -> this rank's chunk: the tensor itself (`reduce` False: computed alike on every rank) or the
    sum over ranks (True: a row-parallel linear's partial sums). Backward gathers the chunks' gradients."""

    @staticmethod
    def forward(ctx, x, group, reduce: bool):
        ctx.group = group
        return _reduce_scatter_seq(x, group) if reduce else _chunk(x, group)

    @staticmethod
    def backward(ctx, g):
        return _all_gather_seq(g, ctx.group), None, None


class _GatherSeq(torch.autograd.Function):
    """Chunks -> whole sequence, optionally as FP8 bytes (E4M3, one scale from the global amax: the cast the
    following FP8 linear makes anyway). Backward: `partial` grads (each rank's heads/width) are summed and split;
    otherwise (a replicated computation follows) each rank keeps its chunk."""

    @staticmethod
    def forward(ctx, x, group, partial: bool, fp8: bool):
        ctx.group, ctx.partial = group, partial
        if not fp8:
            return _all_gather_seq(x, group)
        from lowbit.numerics.scaling import Scaling, all_max, scale_from_amax

        spec = Scaling("e4m3")
        scale, _ = scale_from_amax(all_max(x.detach().abs().amax().float(), group), spec, fallback=1.0)
        fmax = spec.format.max
        q = (x.float() * scale).clamp(-fmax, fmax).to(torch.float8_e4m3fn).view(torch.uint8)
        return (_all_gather_seq(q, group).view(torch.float8_e4m3fn).float() / scale).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter_seq(g, ctx.group) if ctx.partial else _chunk(g, ctx.group)), None, None, None


def _to_chunk(x: torch.Tensor, group, reduce: bool) -> torch.Tensor:
    n = dist.get_world_size(group)
    if reduce:
        SENT["bytes"] += _ring_bytes(x, group)
    if _backward_follows(x):  # backward gathers the chunks' gradients
        SENT["bytes"] += (n - 1) * (x.numel() // n) * x.element_size()
    return _ToChunk.apply(x, group, reduce)


def _gather_seq(x: torch.Tensor, group, partial: bool, fp8: bool) -> torch.Tensor:
    SENT["bytes"] += _gather_bytes(x, group, 1 if fp8 else None)
    if partial and _backward_follows(x):  # backward sums the whole gradient and keeps a chunk
        SENT["bytes"] += 2 * (dist.get_world_size(group) - 1) * x.numel() * x.element_size()  # of n·x's size
    return _GatherSeq.apply(x, group, partial, fp8)


def apply_sequence_parallel(model: nn.Module, group) -> None:
    """On top of apply_tensor_parallel: the residual stream, norms and their inputs hold 1/tp of the sequence.
    The split linears' copy/reduce become gather/scatter along the sequence; block norm weights then get partial
    gradients (`sync_partial_grads`)."""
    fp8 = {}
    for name, m in model.named_modules():
        if name.endswith(("attention.wq", "feed_forward.w1")):
            r = getattr(m, "recipe", None)
            fp8[name.rsplit(".", 2)[0]] = r is not None and (r.input.fmt, r.input.granularity,
                                                              r.input.strategy) == ("e4m3", "tensor", "current")
        if name.endswith(ROW):
            m._forward_hooks.clear()  # the all-reduce becomes a reduce-scatter
            m.register_forward_hook(lambda mod, args, out: _to_chunk(out, group, True))
        elif name.endswith(COLUMN):
            m._forward_pre_hooks.clear()  # the input arrives whole from the norm's gather
    model.tok_embeddings.register_forward_hook(lambda mod, args, out: _to_chunk(out, group, False))
    for name, block in model.named_modules():
        if hasattr(block, "attention_norm") and hasattr(block, "ffn_norm"):
            for norm in (block.attention_norm, block.ffn_norm):
                norm.weight._lowbit_sp_partial = True
                norm.register_forward_hook(
                    lambda mod, args, out, f=fp8.get(name, False): _gather_seq(out, group, True, f))
    model.norm.register_forward_pre_hook(lambda mod, args: (_gather_seq(args[0], group, False, False),))


def sync_partial_grads(model: nn.Module, group) -> None:
    """Sequence parallelism: sum the gradients that each rank computed on its chunk of the sequence."""
    for p in model.parameters():
        if getattr(p, "_lowbit_sp_partial", False) and p.grad is not None:
            SENT["bytes"] += _ring_bytes(p.grad, group)
            _all_reduce(p.grad, group)
