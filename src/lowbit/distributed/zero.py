"""ZeRO stage 1 over the data-parallel replicas: each replica keeps the optimizer states (FP8/FP16 states and their
scales included) of about 1/N of the parameters, updates those, and broadcasts them; gradients are still averaged
whole (GradSync), so clipping sees every gradient.

Ownership is by whole tensor, largest first to the least-loaded replica: deterministic, the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowbit.optim.scaled_weight import ScaledFP16Weight


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner (0..n-1) of each tensor."""
    load, owner = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(n), key=lambda r: load[r])
        owner[i] = r
        load[r] += sizes[i]
    return owner


def _storage(p: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold a parameter's value."""
    return [p._data, p._scale.view(1)] if isinstance(p, ScaledFP16Weight) else [p.data]


class Zero1:
    def __init__(self, optimizer, group):
        self.optimizer, self.group = optimizer, group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.owner = partition([p.numel() for p in self.params], self.n)
        optimizer.shard({p for p, o in zip(self.params, self.owner) if o == self.rank})
        self.bytes_sent = 0

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every owner sends its updated weights as stored (one flat buffer per dtype; fp16 weights as their data
        and scale, whose dequantized bf16 would round them)."""
        for r in range(self.n):
            mine = [t for p, o in zip(self.params, self.owner) if o == r for t in _storage(p)]
            for dtype in sorted({t.dtype for t in mine}, key=str):
                ts = [t for t in mine if t.dtype == dtype]
                flat = torch.cat([t.reshape(-1) for t in ts])
                dist.broadcast(flat, src=dist.get_global_rank(self.group, r), group=self.group)
                if r == self.rank:
                    self.bytes_sent += flat.numel() * flat.element_size() * (self.n - 1)  # a flat tree: N-1 copies
                offset = 0
                for t in ts:
                    t.copy_(flat[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
