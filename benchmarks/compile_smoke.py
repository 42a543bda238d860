"""A two-block fp8 LLaMA compiled by blocks, one training step on the GPU, with the full traceback on failure:
the first check of a device session (bench step's table keeps one line of an error)."""

from __future__ import annotations

import sys
import traceback

import torch

from lowbit.models.llama import Llama, ModelArgs
from lowbit.recipes import convert, get_recipe
from lowbit.train.compile import compile_model


def main() -> int:
    failed = 0
    for name in sys.argv[1:] or ["fp8-tensorwise", "fp8-delayed"]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512,
                                max_seq_len=128)).cuda()
        convert(model, get_recipe(name))
        run = compile_model(model, "blocks")
        x = torch.randint(0, 512, (2, 129), device="cuda")
        try:
            for _ in range(2):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = run(x[:, :-1], x[:, 1:])
                loss.backward()
            print(f"{name}: ok, loss {loss.item():.4f}", flush=True)
        except Exception:
            failed += 1
            print(f"{name}: FAILED", flush=True)
            traceback.print_exc()
    return failed


if __name__ == "__main__":
    sys.exit(main())
