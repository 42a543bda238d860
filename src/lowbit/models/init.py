"""Building a model where it will train: on the meta device first (no memory, no RNG), then its storage allocated
on the target device and every tensor initialized there.

Weights are drawn per parameter, each from a CPU generator of its own, seeded by the model's base seed (one draw
of the global RNG when it is built, so `torch.manual_seed(s)` decides them) and the parameter's name. Independent
streams run in parallel threads (torch's CPU generator is serial: drawn in one stream, with the constructors'
discarded default inits before, LLaMA-7B took about 100 s), and the weights are the same bits on any device, for
any build order: a model built plainly on the CPU and one built on meta and materialized on a GPU start equal.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch
from torch import nn


def param_seed(base: int, name: str) -> int:
    """The seed of parameter `name`'s stream: the base seed and a stable hash of the name, in 63 bits."""
    return (base * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def init_parameters(model: nn.Module, std_of: Callable[[str], float | None], base: int) -> None:
    """Fill every parameter: N(0, std_of(name)) from its own stream (seeded by `base` and the name), or ones
    where std_of gives None."""
    params = list(model.named_parameters())

    def fill(item):
        name, p = item
        std = std_of(name)
        with torch.no_grad():
            if std is None:
                p.fill_(1.0)
                return
            g = torch.Generator().manual_seed(param_seed(base, name))
            host = p if p.device.type == "cpu" and p.dtype == torch.float32 else torch.empty(p.shape)
            host.normal_(0.0, std, generator=g)
            if host is not p:
                p.copy_(host)

    workers = max(1, min(len(params), os.cpu_count() or 1, 32))
    with ThreadPoolExecutor(workers) as pool:  # one serial generator per parameter: they run side by side
        list(pool.map(fill, sorted(params, key=lambda np_: -np_[1].numel())))


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A model built under `torch.device("meta")` given storage on `device` and initialized: its parameters by
    `model.reset_parameters()`, its buffers by `model.init_buffers()` (both required of the model)."""
    model.to_empty(device=device)
    model.init_buffers()
    model.reset_parameters()
    return model
