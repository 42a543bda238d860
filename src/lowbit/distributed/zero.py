"""ZeRO stage 1 over the data-parallel replicas: each replica keeps the optimizer states (FP8/FP16 states and their
scales included) of about 1/N of the parameters, updates those, and broadcasts them; gradients are still averaged
whole (GradSync), so clipping sees every gradient.

Ownership is by whole tensor, largest first to the least-loaded replica: deterministic, the same on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def partition(sizes: list[int], n: int) -> list[int]:
    """Owner (0..n-1) of each tensor."""
    load, owner = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(n), key=lambda r: load[r])
        owner[i] = r
        load[r] += sizes[i]
    return owner


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
        """Every owner sends its updated weights (in their storage dtype, one flat buffer per dtype)."""
        for r in range(self.n):
            mine = [p for p, o in zip(self.params, self.owner) if o == r]
            for dtype in sorted({p.dtype for p in mine}, key=str):
                ps = [p for p in mine if p.dtype == dtype]
                flat = torch.cat([p.data.reshape(-1) for p in ps])
                dist.broadcast(flat, src=dist.get_global_rank(self.group, r), group=self.group)
                if r == self.rank:
                    self.bytes_sent += flat.numel() * flat.element_size() * (self.n - 1)  # a flat tree: N-1 copies
                offset = 0
                for p in ps:
                    p.data.copy_(flat[offset:offset + p.numel()].view(p.shape))
                    offset += p.numel()
