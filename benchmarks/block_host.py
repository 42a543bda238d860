"""The host's cost of a training step of compiled blocks, on the CPU at a size where the kernels take microseconds
(16 tokens x dim 32, one thread): wall time per forward + backward and Python function calls per step (cProfile),
for lowbit recipes and, when installed, torchao's float8 tensorwise linears. On a GPU this host work runs ahead of
the kernels; when it cannot keep ahead, the GPU idles.

    python benchmarks/block_host.py [--blocks 8] bf16 fp8-tensorwise fp8-delayed torchao
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from lowbit.models.llama import Llama, ModelArgs
from lowbit.recipes import convert, get_recipe
from lowbit.train.compile import compile_model


def training_step(name: str, blocks: int):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(ModelArgs(dim=32, n_layers=blocks, n_heads=2, n_kv_heads=1, ffn_dim=64, vocab_size=64,
                            max_seq_len=16))
    if name == "torchao":
        from torchao.float8 import convert_to_float8_training
        model.layers = convert_to_float8_training(model.layers)
    else:
        convert(model, get_recipe(name))
    run = compile_model(model, "blocks")
    x = torch.randint(0, 64, (1, 17))

    def step():
        run(x[:, :-1], x[:, 1:]).backward()
        for p in model.parameters():
            p.grad = None

    return step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("variants", nargs="*", default=["bf16", "fp8-tensorwise"])
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; {a.blocks} compiled blocks, forward + backward, 16 tokens x dim 32, CPU, "
          f"1 thread")
    for name in a.variants:
        step = training_step(name, a.blocks)
        for _ in range(15):  # compiles, then warms
            step()
        ms = []
        for _ in range(100):
            t = time.perf_counter()
            step()
            ms.append((time.perf_counter() - t) * 1e3)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(10):
            step()
        prof.disable()
        calls = sum(nc for _, nc, _, _, _ in pstats.Stats(prof).stats.values()) / 10
        print(f"{name:16s} {statistics.median(ms):6.2f} ms/step (min {min(ms):5.2f})  {calls:7.0f} Python calls/step")


if __name__ == "__main__":
    main()
