"""Data-parallel gradient exchange: every replica ends with the mean of all replicas' gradients.

    fp32  all-reduce in fp32 (the reference)
    bf16  all-reduce in bf16 (half the bytes; the sum is rounded to bf16 as it goes)
    fp8   FP8-LM's exchange without summing in FP8: one shared scale per gradient tensor (from its global amax,
          one all-reduce MAX for all tensors), the gradients cast to FP8 under it (pre-, post- or automatic scaling, as `optim.grad_scaling.fp8_sum`),
          a reduce-scatter built from an all-to-all of the FP8 bytes with the sum of each shard taken in fp32,
          the shard sums cast back to FP8 under the same scale (post scaling may saturate here: what auto
          scaling's mu watches), and an all-gather of those bytes. 2·(N−1)/N bytes per gradient element on the
          wire, against 4·(N−1)/N for a bf16 ring all-reduce.

Gradients are read wherever the optimizer keeps them (`p.grad`, or a low-precision GradStore) and written back
there. `bytes_sent` counts what this rank puts on the wire, ring all-reduce counted as 2·(N−1)/N of the payload.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lowbit.errors import LowbitError
from lowbit.formats import get_format
from lowbit.optim.grad_scaling import AutoScale
from lowbit.optim.precision import _pow2_scale

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
BUCKET = 1 << 25  # elements per exchange (128 MiB of fp32): bounds the extra memory of the flat copy


class GradSync:
    def __init__(self, group, mode: str = "fp32", fmt: str = "e4m3", scaling: str = "auto"):
        if mode not in ("fp32", "bf16", "fp8"):
            raise LowbitError(f"parallel.grad_sync: {mode!r} is not one of fp32, bf16, fp8")
        if scaling not in ("pre", "post", "auto"):
            raise LowbitError(f"parallel.grad_scaling: {scaling!r} is not one of pre, post, auto")
        self.group, self.mode, self.scaling = group, mode, scaling
        self.fmt = get_format(fmt)
        self.world = dist.get_world_size(group) if group is not None else 1
        self.auto = AutoScale(self.world)
        self.bytes_sent = 0  # since the last reset (the trainer reports it per step)
        self.overflow_ratio = 0.0  # of the last fp8 exchange

    # ---- which tensors ----
    @staticmethod
    def _slots(optimizer) -> list:
        """(param, store or None) for every trainable parameter, in the same order on every rank."""
        stores = getattr(optimizer, "_grads", {})
        return [(p, stores.get(p)) for g in optimizer.param_groups for p in g["params"] if p.requires_grad]

    @torch.no_grad()
    def sync(self, optimizer) -> None:
        if self.world == 1:
            return
        slots = self._slots(optimizer)
        values = []
        for p, store in slots:
            if store is not None:
                values.append(store.value() if store.filled else torch.zeros(p.shape, device=p.device))
            else:
                values.append(p.grad.float() if p.grad is not None else torch.zeros(p.shape, device=p.device))
        flat = torch.cat([v.reshape(-1) for v in values])
        scales, bad = self._shared_scales(values) if self.mode == "fp8" else (None, None)
        over = torch.zeros((), device=flat.device)
        for start in range(0, flat.numel(), BUCKET):
            part = flat[start:start + BUCKET]
            if self.mode == "fp8":
                mean, o = self._fp8_mean(part, scales[start:start + BUCKET])
                part.copy_(mean)
                over += o
            else:
                part.copy_(self._mean(part))
        if self.mode == "fp8":
            dist.all_reduce(over, group=self.group)
            self.bytes_sent += self._ring_bytes(1, 4)
            self.overflow_ratio = over.item() / max(flat.numel(), 1)
            if self.scaling == "auto":
                self.auto.update(self.overflow_ratio)
            if bad:  # a non-finite gradient on any rank: every rank sees NaN, and the step is skipped everywhere
                flat.fill_(float("nan"))
        offset = 0
        for (p, store), v in zip(slots, values):
            mean = flat[offset:offset + v.numel()].view(p.shape)
            offset += v.numel()
            if store is not None:
                store.clear()
                store.add(mean)
            elif p.grad is not None:
                p.grad.copy_(mean)
            else:
                p.grad = mean.to(p.dtype).clone()

    # ---- one bucket ----
    def _ring_bytes(self, numel: int, itemsize: int) -> int:
        return 2 * (self.world - 1) * numel * itemsize // self.world

    def _mean(self, x: torch.Tensor) -> torch.Tensor:
        n = self.world
        if self.mode == "fp32":
            y = x.clone()
            dist.all_reduce(y, group=self.group)
            self.bytes_sent += self._ring_bytes(y.numel(), 4)
            return y / n
        y = x.to(torch.bfloat16)
        dist.all_reduce(y, group=self.group)
        self.bytes_sent += self._ring_bytes(y.numel(), 2)
        return y.float() / n

    def _shared_scales(self, values: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
        """Per element of the flat gradient: its tensor's shared scale (from the amax over all ranks, one
        all-reduce MAX for every tensor) times the scaling mode's factor; and whether any rank has a non-finite
        gradient."""
        amax = torch.stack([v.abs().amax() for v in values]).float()
        bad = ~torch.isfinite(amax).all()
        stats = torch.cat([torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax)), bad.float().view(1)])
        dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=self.group)
        self.bytes_sent += self._ring_bytes(stats.numel(), 4)
        factor = {"pre": 1.0 / self.world, "post": 1.0, "auto": self.auto.mu}[self.scaling]
        scale = _pow2_scale(stats[:-1], self.fmt.max, torch.ones_like(stats[:-1])) * factor
        sizes = torch.tensor([v.numel() for v in values], device=scale.device)
        return torch.repeat_interleave(scale, sizes), bool(stats[-1] > 0)

    def _fp8_mean(self, x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean over ranks of x (scaled by `scale`, shared by all ranks), FP8 on the wire; and the number of
        shard sums that saturated."""
        n, f = self.world, self.fmt
        numel = x.numel()
        pad = (-numel) % n
        if pad:
            x, scale = torch.cat([x, x.new_zeros(pad)]), torch.cat([scale, scale.new_ones(pad)])
        q = (x * scale).clamp_(-f.max, f.max).to(f.torch_dtype)
        # reduce-scatter: rank r receives everyone's shard r (FP8 bytes) and sums it in fp32 (same scales on
        # every rank, so the scaled values add directly)
        received = torch.empty_like(q.view(torch.uint8))
        dist.all_to_all_single(received, q.view(torch.uint8), group=self.group)
        self.bytes_sent += (n - 1) * q.numel() // n
        shard = received.view(f.torch_dtype).view(n, -1).float().sum(0)
        over = (shard.abs() > f.max).sum().float()
        shard_q = shard.clamp_(-f.max, f.max).to(f.torch_dtype)
        gathered = torch.empty_like(q.view(torch.uint8))
        _all_gather(gathered, shard_q.view(torch.uint8), group=self.group)
        self.bytes_sent += (n - 1) * q.numel() // n
        return (gathered.view(f.torch_dtype).float() / (scale * n))[:numel], over

    def state_dict(self) -> dict:
        return {"auto": self.auto.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.auto.load_state_dict(state["auto"])
