"""What a process contributes to a checkpoint: its pieces of the whole model and optimizer, under global names.

torch.distributed.checkpoint writes each piece once (replicas are deduplicated) with its place in the whole tensor,
and reads back whatever pieces another layout asks for. So no process ever holds the whole model:
- tensor parallelism: a split tensor is a DTensor, this rank's shard of the whole (Shard(dim) over tp);
- pipeline parallelism: a stage names only its own blocks' tensors;
- ZeRO-1: a replica names only the optimizer states it owns;
- FSDP2: parameters are DTensors already (this rank's dim-0 shard), and their optimizer states, kept beside the
  local shard, are wrapped with the parameter's placements;
- fp16 weights (ScaledFP16Weight): their FP16 data, the scale being the optimizer state `weights_scale`;
- everything else is replicated and named by every process alike.
The same dict is the target of a load: the tensors are the live ones, so loading fills them in place.
"""

from __future__ import annotations

import torch
from torch import nn

from lowbit.distributed.fsdp_fp8 import plain
from lowbit.distributed.tensor_parallel import sharded_names
from lowbit.optim.scaled_weight import stored_scaled

MODEL, OPTIMIZER = "model.", "optimizer."


def _piece(t: torch.Tensor, dim: int | None, tp_mesh):
    if tp_mesh is None or dim is None or t.dim() == 0:
        return t
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(t, tp_mesh, [Shard(dim)], run_check=False)


def _like_param(v: torch.Tensor, p: torch.Tensor):
    """An FSDP2 parameter's state (this rank's part, shaped like its shard) as a DTensor placed like it."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor) or v.shape != p.to_local().shape:
        return v
    return DTensor.from_local(v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def checkpoint_tensors(model: nn.Module, optimizer, mesh) -> dict[str, torch.Tensor]:
    """Flat {global name: this process's piece}: "model.<state key>" and "optimizer.<parameter>.<state>"."""
    tp_mesh = mesh.device_mesh["tp"] if mesh.sizes["tp"] > 1 else None
    dims = sharded_names(model)
    out = {MODEL + k: _piece(stored_scaled(plain(v)), dims.get(k), tp_mesh) for k, v in model.state_dict().items()}
    name_of = {p: n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = name_of[p]
            for k, v in optimizer.state.get(p, {}).items():  # empty: another replica owns it (ZeRO-1)
                if isinstance(v, torch.Tensor):
                    v = _like_param(v, p)
                    out[f"{OPTIMIZER}{name}.{k}"] = _piece(v, dims.get(name) if v.shape == p.shape else None,
                                                           tp_mesh)
    return out
