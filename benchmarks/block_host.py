"""The host's cost of one compiled block's forward + backward, on the CPU at a size where the kernels take
microseconds (16 tokens x dim 32, one thread): wall time per call and Python function calls per call (cProfile),
for lowbit recipes and, when installed, torchao's float8 tensorwise linears. On a GPU this host work runs ahead of
the kernels; when it cannot keep ahead, the GPU idles.

    python benchmarks/block_host.py bf16 fp8-tensorwise fp8-delayed torchao
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

import torch

from lowbit.models.llama import Llama, ModelArgs, rope_tables
from lowbit.recipes import convert, get_recipe


def block(name: str):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64, max_seq_len=16))
    if name == "torchao":
        from torchao.float8 import convert_to_float8_training
        model.layers = convert_to_float8_training(model.layers)
    else:
        convert(model, get_recipe(name))
    blk = model.layers[0]
    blk.compile()
    x = torch.randn(1, 16, 32, requires_grad=True)
    cos, sin = rope_tables(16, 16, 10000.0)
    return lambda: blk(x, cos, sin).sum().backward()


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; one compiled block, forward + backward, 16 tokens x dim 32, CPU, 1 thread")
    for name in names:
        once = block(name)
        for _ in range(20):  # compiles, then warms
            once()
        us = []
        for _ in range(300):
            t = time.perf_counter()
            once()
            us.append((time.perf_counter() - t) * 1e6)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            once()
        prof.disable()
        calls = sum(nc for _, nc, _, _, _ in pstats.Stats(prof).stats.values()) / 10
        print(f"{name:16s} {statistics.median(us):7.1f} us/call (min {min(us):6.1f})  {calls:6.0f} Python calls/call")


if __name__ == "__main__":
    main(sys.argv[1:] or ["bf16", "fp8-tensorwise"])
