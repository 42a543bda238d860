"""ATen operators per training step on CPU, split by phase: forward+backward, the gradient hooks (GradStore.add,
which run inside backward), clip_grad_norm_, optimizer.step, zero_grad. On a GPU every top-level ("dispatched")
operator of an eager phase is at least one kernel launch; forward+backward and the update are compiled there, the
hooks and clipping are not. Also prints the losses of a few steps, to check a change is bit-identical.

    PYTHONPATH=src python benchmarks/step_ops.py [--recipes fp8-tensorwise,nanotron-r2,fp8lm-o2] [--micro 2]
        [--compile-optim]

--compile-optim compiles what LowbitAdamW compiles on a GPU (the update chunks, the stored-gradient norms, the
gradient hooks' quantization) on the CPU too: a compiled call then counts as one "compiled" call, its fused
kernels are not aten ops.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

import lowbit.optim.adamw as adamw
from lowbit.models.llama import Llama, resolve_model_args
from lowbit.recipes import convert, get_recipe
from lowbit.train.config import ModelConfig, load_config, optim_precision
from lowbit.train.trainer import build_optimizer

PHASES = ("fwd+bwd", "hooks", "clip", "step", "zero_grad")


def build(recipe_name: str, preset: str, seq: int, vocab: int):
    cfg = load_config(None, ["--recipe", recipe_name])
    torch.manual_seed(0)
    model = Llama(resolve_model_args(ModelConfig(preset=preset), vocab_size=vocab, seq_len=seq))
    recipe = get_recipe(recipe_name)
    convert(model, recipe)
    return model, build_optimizer(model, recipe, optim_precision(cfg), cfg)


def counts(prof) -> dict[str, list[int]]:
    """phase -> [top-level aten ops, all aten ops, compiled calls]: an event belongs to its innermost enclosing
    phase label."""
    out = {ph: [0, 0, 0] for ph in PHASES}
    for e in prof.events():
        compiled = e.name.startswith("Torch-Compiled Region")
        if not e.name.startswith("aten::") and not compiled:
            continue
        top, parent, phase = True, e.cpu_parent, None
        while parent is not None:
            if parent.name in PHASES:
                phase = parent.name
                break
            top = top and not parent.name.startswith("aten::")
            parent = parent.cpu_parent
        if phase is not None and compiled:
            out[phase][2] += 1
        elif phase is not None:
            out[phase][0] += top
            out[phase][1] += 1
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--recipes", default="fp8-tensorwise,nanotron-r2,fp8lm-o2")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--micro", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--steps", type=int, default=4, help="steps before the profiled one (losses printed)")
    p.add_argument("--compile-optim", action="store_true")
    a = p.parse_args()
    add = adamw.GradStore.add

    def labelled_add(self, g):
        with torch.profiler.record_function("hooks"):
            add(self, g)
    adamw.GradStore.add = labelled_add
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, a.vocab, (a.steps + 1, a.micro, a.batch, a.seq + 1), generator=g)
    print(f"preset {a.preset}, {a.micro} micro-batches of {a.batch} x {a.seq}; per step: top-level aten ops / all "
          f"aten ops / compiled calls")
    for name in a.recipes.split(","):
        model, opt = build(name, a.preset, a.seq, a.vocab)
        if a.compile_optim:
            opt._compile = True
            for store in opt._grads.values():  # chosen at construction (absent before session 7)
                if hasattr(adamw, "_accumulate"):
                    store._fn = opt._fn(adamw._accumulate, store.data.device)
        label = torch.profiler.record_function
        losses = []

        def step():
            with label("fwd+bwd"):
                total = 0.0
                for xy in data[len(losses)]:
                    loss = model(xy[:, :-1], xy[:, 1:])
                    (loss / a.micro).backward()
                    total += loss.item() / a.micro
            with label("clip"):
                opt.clip_grad_norm_(1.0)
            with label("step"):
                opt.step()
            with label("zero_grad"):
                opt.zero_grad(set_to_none=True)
            losses.append(total)

        for _ in range(a.steps):
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False) as prof:
            step()
        c = counts(prof)
        row = " | ".join(f"{ph} {'/'.join(map(str, c[ph]))}" for ph in PHASES)
        print(f"{name}: {row} | total {'/'.join(str(sum(v[i] for v in c.values())) for i in range(3))}")
        print(f"  losses {[float.hex(x) for x in losses]}")


if __name__ == "__main__":
    main()
