"""torch.compile of a Llama, as one graph or region by region.

`model` scope: the whole forward is one graph. It fuses across block boundaries, but dynamo and inductor work
through every block, so compiling takes longer the deeper the model (96–105 s for the 125m shape, 192 s for 350m
with fp8-tensorwise on an H200, BENCHMARKS.md). Its steps can be faster: at 125m, 51.6 against 70.0 ms.

`blocks` scope (regional compilation): each block is compiled on its own, and so is the head (final norm, output
projection, loss). The blocks are alike and their parameters are graph inputs, so the first block's compiled code
serves every block: compiling costs one block, whatever the depth (18 s at 125m). Nothing fuses across a block
boundary. Activation checkpointing is applied inside each block, so its recomputation stays in the block's graph.

Blocks are compiled in place, so everything that runs them (the pipeline stages, evaluation) runs them compiled;
`eager()` runs a step without compilation (the telemetry steps: their statistics are host-side Python).
"""
from __future__ import annotations

import torch

from lowbit.train.config import COMPILE_SCOPES as SCOPES


def compile_model(model, scope: str = "blocks", **options):
    """The callable to run `model` through: compiled whole (`model`), or `model` itself with its blocks and
    head compiled (`blocks`). `options` go to torch.compile (backend, mode, ...)."""
    # A checkpointed block's forward updates current scaling states (delayed ones are only read: their amaxes
    # are recorded after backward), which its recomputation must not replay; dynamo refuses such side effects
    # inside the checkpoint (a graph break: the block would run eagerly) unless told to keep them to the
    # forward. A global dynamo setting.
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    if scope == "model":
        return torch.compile(model, **options)
    if scope != "blocks":
        raise ValueError(f"compile scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    for layer in model.layers:
        layer.compile(**options)
    if getattr(model, "norm", None) is not None:  # a pipeline stage without the head has none
        model.head = torch.compile(model.head, **options)
    return model


def eager():
    """Context: compiled code runs eagerly (same numerics; host-side hooks see every op)."""
    return torch.compiler.set_stance("force_eager")
