"""A weight whose only copy is FP16 with a per-tensor power-of-two scale: FP8-LM's O2 weights (MS-AMP keeps them
as a scaled FP16 tensor), selected by `optim.weights = "fp16"`.

Two bytes a parameter, as bf16, but 10 mantissa bits instead of 7: with W ~ N(0, 0.02) an update of 1e-4 is under
half a bf16 ulp for about 12% of the entries (|w| >= 2^-5), which round-to-nearest then drops; in FP16 none is. The
scale puts the tensor's amax at the top of FP16's range, so no weight overflows and few fall into subnormals.

A wrapper tensor subclass, written here because torch has no scaled-storage parameter: to autograd and the model
it is a bf16 tensor. Its dtype is bf16, so gradients arrive in bf16 (FP16 gradients would underflow without loss
scaling), and every op that reads it sees the dequantized value data / scale, rounded to bf16. An in-place op on it
is computed on the fp32 value and stored back with a fresh scale. The optimizer reads and writes `_data` and
`_scale` directly: they are its master. Checkpoints hold both, the data under the model's key and the scale as
the optimizer state `weights_scale` (the same tensor object). It implements torch's flatten/unflatten protocol,
so torch.compile traces through it.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from lowbit.optim.precision import decode, encode

aten = torch.ops.aten
_ALIASES = {aten.detach.default, aten.alias.default}  # how autograd, state_dict and the optimizer take it


class ScaledFP16Weight(torch.Tensor):
    """`_data` (float16) / `_scale` (0-dim fp32, a power of two), seen as a bf16 tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor):
        # the inner tensors set here, not in __init__: torch.compile reads them (__tensor_flatten__) from the new
        # object before any __init__ would run
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), dtype=torch.bfloat16,
                                                device=data.device)
        t._data, t._scale = data, scale
        return t

    @classmethod
    def of(cls, w: torch.Tensor) -> ScaledFP16Weight:
        """`w` stored with the scale of its own amax."""
        scale = torch.ones((), device=w.device)
        return cls(encode(w.detach().float(), "fp16", scale), scale)

    def value(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return decode(self._data, "fp16", self._scale).to(dtype)

    def assign(self, x: torch.Tensor) -> None:
        """Store `x` (in place), with the scale of its amax. The data's version is bumped by hand: under
        __torch_dispatch__ an in-place op counts no version, and the optimizer's record of the stored amax
        (LowbitAdamW._unknown_if_written) reads it."""
        encode(x.float(), "fp16", self._scale, out=self._data)
        torch.autograd.graph.increment_version(self._data)

    def __repr__(self):  # no .item(): torch.compile may print a fake one
        return f"ScaledFP16Weight(shape={tuple(self.shape)}, scale={self._scale!r})"

    def _stable_hash_for_caching(self) -> str:  # AOTAutograd's cache key: no metadata beyond the class
        return type(self).__name__

    def __tensor_flatten__(self):
        return ["_data", "_scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledFP16Weight(inner["_data"], inner["_scale"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIASES:
            return cls(func(args[0]._data), args[0]._scale)
        read = lambda t: t.value(torch.bfloat16) if isinstance(t, cls) else t  # noqa: E731
        target = args[0] if args else None
        if func._schema.is_mutable and isinstance(target, cls) and func.__name__.split(".")[0].endswith("_"):
            x = target.value()  # an in-place op (copy_, mul_, ...): computed in fp32, stored back
            func(x, *pytree.tree_map(read, args[1:]), **pytree.tree_map(read, kwargs))
            target.assign(x)
            return target
        if func._schema.is_mutable and any(isinstance(t, cls) for t in pytree.tree_leaves((args, kwargs))):
            raise TypeError(f"{func}: a ScaledFP16Weight is written only in place (or by the optimizer)")
        return func(*pytree.tree_map(read, args), **pytree.tree_map(read, kwargs))


def stored_scaled(t: torch.Tensor) -> torch.Tensor:
    """What a checkpoint holds of a model tensor: a ScaledFP16Weight's FP16 data (its scale is an optimizer
    state), any other tensor itself."""
    return t._data if isinstance(t, ScaledFP16Weight) else t
