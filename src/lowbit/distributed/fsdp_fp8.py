"""FP8 weight all-gather under FSDP2 (FP8-LM's O3 communicates FP8 weights): half the bytes of bf16, a quarter of
fp32, and the same numerics as casting the whole weight.

A tensorwise-E4M3 LowPrecisionLinear's weight becomes a `FP8GatherWeight`: a plain fp32/bf16 tensor for everything
(optimizer, clipping, checkpoints see its `_data`) except FSDP2's all-gather, through FSDP2's extension hooks:
- `fsdp_pre_all_gather`: the shard's amax, all-reduced (MAX) over the shard group into the whole weight's amax,
  gives the scale the layer would have picked for the whole weight; the shard is cast with it and sent as bytes;
- `fsdp_post_all_gather`: the gathered bytes become a `GatheredFP8`, the quantized whole weight, which the layer
  uses as its weight operand as is (its scale and amax are recorded as the layer's own cast would have).
The cast is elementwise with a shared scale, so the bytes are those of quantizing the unsharded weight. The
amax all-reduce of every weight is one collective after the optimizer step (`precompute_amax`), valid until the
weight changes again (counted in `_changes`, shared by its views); without it each gather reduces its own.
Anything else done with a GatheredFP8 (a norm, a telemetry statistic) sees its dequantized value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from lowbit.numerics.qtensor import QTensor, cast
from lowbit.numerics.scaling import Scaling, scale_from_amax

aten = torch.ops.aten
# views of a parameter FSDP2 and the optimizer take: the same data, so the same record of its changes
_VIEWS = {aten.detach.default, aten.alias.default, aten.split.Tensor, aten.split_with_sizes.default,
          aten.chunk.default, aten.slice.Tensor, aten.narrow.default, aten.view.default, aten.as_strided.default}
# ops FSDP2 shards, pads, copies and views a parameter with: their results stay FP8GatherWeight
_KEEP = {aten.detach.default, aten.alias.default, aten.empty_like.default, aten.new_zeros.default,
         aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.slice.Tensor,
         aten.narrow.default, aten.view.default, aten.as_strided.default, aten.clone.default,
         aten._to_copy.default, aten.copy_.default, aten._pin_memory.default}
# ops FSDP2 applies to the unsharded (gathered) weight: views of the FP8 bytes
_GATHERED_VIEWS = {aten.detach.default, aten.alias.default, aten.view.default, aten.as_strided.default,
                   aten.slice.Tensor}


def _wrapper(cls, like: torch.Tensor, dtype: torch.dtype, shape=None, strides=None):
    return torch.Tensor._make_wrapper_subclass(cls, shape if shape is not None else like.shape,
                                               strides=strides if strides is not None else like.stride(),
                                               dtype=dtype, device=like.device, requires_grad=like.requires_grad)


class FP8GatherWeight(torch.Tensor):
    """A weight (the FSDP2 shard of it) that is all-gathered as E4M3 bytes with one scale for the whole tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, spec: Scaling, changes: list | None = None):
        return _wrapper(cls, data, data.dtype)

    def __init__(self, data: torch.Tensor, spec: Scaling, changes: list | None = None):
        self._data, self._spec = data, spec
        # in-place changes of the data, shared with its views (torch's version counter does not see them: they
        # happen below autograd); `_amax` is the whole weight's amax when the count was `_amax_at`
        self._changes = changes if changes is not None else [0]
        self._amax, self._amax_at = None, -1

    def __repr__(self):
        return f"FP8GatherWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return FP8GatherWeight(inner["_data"], spec)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t._data if isinstance(t, cls) else t  # noqa: E731
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        if func._schema.is_mutable:  # an optimizer step, a checkpoint load: a precomputed amax is now stale
            for t in pytree.tree_leaves((args, kwargs)):
                if isinstance(t, cls):
                    t._changes[0] += 1
        if func in _KEEP:
            changes = first._changes if func in _VIEWS else None
            return pytree.tree_map_only(torch.Tensor, lambda t: cls(t, first._spec, changes), out)
        return out

    # ---- FSDP2's all-gather extension ----
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        s = self._spec
        local = self._data
        amax = self._amax if self._amax_at == self._changes[0] else None  # precompute_amax's, if still true
        if amax is None:
            amax = local.detach().abs().amax().float() if local.numel() else torch.zeros((), device=local.device)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        state = module.scaling["weight"]
        # A bad amax keeps the state's last good scale where scaling.current_scale uses 1: a weight holding NaN/Inf
        # or only zeros is cast differently, every other weight the same.
        scale, bad = scale_from_amax(amax, s, fallback=state.scale)
        q = cast(local, scale, s)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 sends every shard padded to the largest one's rows
        if q.shape[0] != rows:
            q = torch.cat([q, q.new_zeros(rows - q.shape[0], *q.shape[1:])])
        # bytes, not float8: every backend (gloo too) all-gathers uint8
        return (q.view(torch.uint8),), (scale.reciprocal(), amax, bad)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        scale_inv, amax, bad = metadata
        if out is not None:  # the same gathered buffer again: only the scale is new
            out._scale_inv, out._amax, out._bad = scale_inv, amax, bad
            return
        fp8 = data.view(self._spec.format.torch_dtype)
        return GatheredFP8(fp8, scale_inv, amax, bad, self._spec, param_dtype or self.dtype), (data,)


class GatheredFP8(torch.Tensor):
    """The whole weight after an FP8 all-gather: E4M3 data and its scale_inv, in the shape and dtype of the
    high-precision weight."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data, scale_inv, amax, bad, spec, dtype):
        return _wrapper(cls, data, dtype)

    def __init__(self, data, scale_inv, amax, bad, spec, dtype):
        self._fp8, self._scale_inv, self._amax, self._bad, self._spec = data, scale_inv, amax, bad, spec

    def __repr__(self):
        return f"GatheredFP8(shape={tuple(self.shape)}, scale_inv={self._scale_inv.item():.3g})"

    def quantized(self) -> QTensor:
        return QTensor(self._fp8, self._scale_inv, self._spec)

    def __tensor_flatten__(self):
        return ["_fp8", "_scale_inv", "_amax", "_bad"], (self._spec, self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return GatheredFP8(inner["_fp8"], inner["_scale_inv"], inner["_amax"], inner["_bad"], *meta)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in _GATHERED_VIEWS and isinstance(args[0], cls):
            w = args[0]
            data = func(w._fp8, *args[1:], **(kwargs or {}))
            return cls(data, w._scale_inv, w._amax, w._bad, w._spec, w.dtype)
        dequant = lambda t: (t._fp8.float() * t._scale_inv).to(t.dtype) if isinstance(t, cls) else t  # noqa: E731
        return func(*pytree.tree_map(dequant, args), **pytree.tree_map(dequant, kwargs or {}))


def gathers_in_fp8(spec: Scaling) -> bool:
    """Whether a weight cast with `spec` can travel as FP8 bytes: one current scale for the whole tensor."""
    return spec.granularity == "tensor" and spec.strategy == "current" and spec.format.name in ("e4m3", "e5m2")


def wrap_fp8_gather(model: torch.nn.Module) -> list[str]:
    """Make the weight of every LowPrecisionLinear whose weight scaling allows it an FP8GatherWeight (before
    fully_shard). A weight shared with another module (tied embeddings) is left alone: the embedding lookup needs
    its high-precision values. Returns the names of the wrapped weights."""
    from lowbit.numerics.linear import LowPrecisionLinear

    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    wrapped = []
    for name, m in model.named_modules():
        if isinstance(m, LowPrecisionLinear) and gathers_in_fp8(m.recipe.weight) and uses[id(m.weight)] == 1:
            m.weight = torch.nn.Parameter(FP8GatherWeight(m.weight.data, m.recipe.weight),
                                          requires_grad=m.weight.requires_grad)
            wrapped.append(f"{name}.weight")
    return wrapped


@torch.no_grad()
def precompute_amax(model: torch.nn.Module) -> None:
    """The whole-weight amax of every FP8GatherWeight in one all-reduce (after the optimizer step), instead of
    one small all-reduce per weight inside FSDP's all-gathers. Each is kept with the version of the data it was
    taken from, so a weight changed since then is measured again, never cast with a stale scale."""
    from torch.distributed.tensor import DTensor

    # `_local_tensor` itself: the object FSDP calls fsdp_pre_all_gather on (to_local() returns a fresh alias)
    sharded = [p for p in model.parameters()
               if isinstance(p, DTensor) and isinstance(p._local_tensor, FP8GatherWeight)]
    if not sharded:
        return
    mesh = sharded[0].device_mesh  # one mesh for the whole model
    group = mesh.get_group(mesh.ndim - 1)  # the shard dimension (HSDP: the last of dp × dp_shard)
    shards = [p._local_tensor for p in sharded]
    datas = [w._data for w in shards]
    amax = torch.stack([d.abs().amax().float() if d.numel() else d.new_zeros((), dtype=torch.float32)
                        for d in datas])
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    for w, a in zip(shards, amax.unbind()):
        w._amax, w._amax_at = a, w._changes[0]


def plain(t: torch.Tensor) -> torch.Tensor:
    """A sharded FP8GatherWeight parameter as the DTensor of its high-precision data (what checkpoints hold)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, FP8GatherWeight):
        return DTensor.from_local(t._local_tensor._data, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t
