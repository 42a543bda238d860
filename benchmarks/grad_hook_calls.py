"""Host time of the FP8 gradient hooks' compiled calls, on the CPU: 154 `GradStore.add` calls (one per covered
weight of the `1b` preset) through `torch.compile(_accumulate, dynamic=True)` on small tensors, so the time is the
calls' overhead (dynamo guards, inductor's wrapper), not their arithmetic. BENCHMARKS.md, session 10.

    PYTHONPATH=src python benchmarks/grad_hook_calls.py
"""

import time

import torch

from lowbit.optim.adamw import GradStore, _accumulate

fn = torch.compile(_accumulate, dynamic=True)
stores = [GradStore(torch.empty(64, 64 + 8 * (i % 3)), "e4m3", fn) for i in range(154)]
grads = [torch.randn(s.data.shape) for s in stores]
for _ in range(5):  # the first round compiles
    for s in stores:
        s.clear()
    t0 = time.perf_counter()
    for s, g in zip(stores, grads):
        s.add(g)
    t1 = time.perf_counter()
    for s, g in zip(stores, grads):
        s.add(g)
    t2 = time.perf_counter()
    print(f"154 adds into empty stores: {(t1 - t0) * 1e3:.1f} ms; into filled ones: {(t2 - t1) * 1e3:.1f} ms")
