"""Work deferred to the end of a backward pass.

Hooks that run once per tensor during backward (scaling reports, FP8 gradient stores) launch their own small
kernels from the autograd thread; one by one they starve the GPU. They queue their work instead and ask for it to
be done, batched, when the pass ends: an autograd engine callback, run once per pass however many hooks ask.
"""

from __future__ import annotations

from typing import Callable

import torch

_queued: dict[Callable[[], None], int] = {}  # callback -> the backward pass (graph task) it is queued on


def at_backward_end(fn: Callable[[], None]) -> None:
    """Run `fn` once when the running backward pass ends. Call it from inside a backward (a hook)."""
    task = torch._C._current_graph_task_id()
    if _queued.get(fn) != task:  # task ids are never reused, so a pass that failed leaves nothing stale
        _queued[fn] = task
        torch.autograd.Variable._execution_engine.queue_callback(fn)
