"""The optimizer's device work replayed as a CUDA graph.

The lowbit update and the stored gradients' norms are about 40 compiled calls per step at `1b`; each costs
host time (guards, launches) while the GPU waits: fp8lm-o2's optimizer phase took 33 ms against 13 ms for fused
fp32 AdamW. Every tensor these calls touch lives as long as the optimizer (states, gradient stores, weights, a
learning-rate buffer), so once a call has run eagerly its kernels can be captured and replayed: one launch.

A `Graphed` call is keyed by everything it bakes in: the address of every tensor it reads or writes and every
Python value it uses. A key seen for the first time runs eagerly (it compiles, allocates); the same key the next
time is captured and replayed, and replayed from then on. A new key (a parameter without a gradient this step, a
state replaced by a checkpoint load) runs eagerly again; after `limit` captures the call stays eager for good, and
so does one whose key is None.
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch


class Graphed:
    def __init__(self, device: torch.device, limit: int = 4):
        self.device = device
        self.limit = limit
        self.captures = 0
        self.seen = None  # the key of the last eager run
        self.key = self.graph = self.out = None
        self.stream = None  # the capture stream, on `device` (the default one is on whichever device came first)

    def __call__(self, key, fn: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """fn() (its output a tensor or None), run eagerly or replayed as `key` says. A returned tensor is a copy:
        the graph's own output is overwritten by the next replay."""
        if key is None:
            return fn()
        with torch.cuda.device(self.device):  # capture records only the current device's work
            if self.graph is not None and key == self.key:
                self.graph.replay()
                return None if self.out is None else self.out.clone()
            if key != self.seen or self.captures >= self.limit:
                self.seen = key
                return fn()
            self.graph = self.out = None  # the old graph's memory pool goes before the new one is taken
            self.captures += 1
            self.stream = self.stream or torch.cuda.Stream(self.device)
            graph = torch.cuda.CUDAGraph()
            try:  # thread_local: a data-loader or checkpoint thread's CUDA calls during capture are not an error
                with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                    out = fn()
            except Exception as e:  # capture records, it runs nothing: the step is still to be done, eagerly
                warnings.warn(f"lowbit: the optimizer's CUDA graph capture failed ({type(e).__name__}: {e}); "
                              f"it runs eagerly from now on")
                self.captures = self.limit
                return fn()
            self.graph, self.key, self.out = graph, key, out
            graph.replay()  # capture only records: this runs the step
            return None if out is None else out.clone()


def key_of(items) -> tuple | None:
    """A key for nested tuples/lists of tensors and plain values. A contiguous tensor by its address, size and
    dtype: the calls replayed here see only its flat memory (elementwise updates, whole-tensor reductions), so its
    shape is not needed, and reading shapes and strides was about a third of the key's host time (fp8lm-o2's update
    at a 7b layout, 2,515 tensors: 1.67 -> 1.16 ms on a 2-core Xeon). Other tensors add their shape and strides.
    None (never captured) if a tensor is a subclass: its address is not its data's (FSDP's FP8 gather weights), and
    a replay would skip its Python dispatch."""
    out = []
    for x in items:
        kind = type(x)
        if kind is torch.Tensor or kind is torch.nn.Parameter:
            out.append((x.data_ptr(), x.numel(), x.dtype) if x.is_contiguous() else
                       (x.data_ptr(), x.dtype, tuple(x.shape), x.stride()))
        elif kind is list or kind is tuple:
            inner = key_of(x)
            if inner is None:
                return None
            out.append(inner)
        elif isinstance(x, torch.Tensor):
            return None
        else:
            out.append(x)
    return tuple(out)
