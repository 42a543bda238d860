"""FSDP2 (`parallel.dp_shard`): PyTorch's fully_shard over the dp_shard ranks, each block its own unit.

Every parameter becomes a DTensor holding this rank's dim-0 shard; a block's weights are all-gathered just before
it runs (forward, and again in backward) and its gradients reduce-scattered right after, averaged in fp32 or bf16
(`parallel.grad_sync`). With dp > 1 as well the mesh is 2-D (HSDP): sharded over dp_shard, replicated over dp,
the shards' gradients all-reduced over dp. So lowbit's own gradient exchange stays off, the optimizer updates
local shards (LowbitAdamW), clipping adds the shards' squared norms over the shard group, and the checkpoint
pieces are the shards themselves (`sharded_state`).

Low-precision linears see whole weights in forward (the all-gather ran before), so every recipe's GEMMs apply.
Where a layer casts its weight to FP8 with one current scale for the whole tensor (fp8-tensorwise), the
all-gather moves the FP8 bytes instead (`fsdp_fp8`, FP8-LM's O3 communication); other weights travel in their
storage dtype.
"""

from __future__ import annotations

import torch
from torch import nn

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def apply_fsdp(model: nn.Module, mesh, reduce: str, fp8_gather: bool = True) -> list[str]:
    """Shard `model` (a Llama, in place) over the mesh's dp_shard ranks (dp × dp_shard when dp > 1). Returns
    the weights all-gathered in FP8."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from lowbit.distributed.fsdp_fp8 import wrap_fp8_gather

    wrapped = wrap_fp8_gather(model) if fp8_gather else []
    device_mesh = mesh.device_mesh["dp", "dp_shard"] if mesh.sizes["dp"] > 1 else mesh.device_mesh["dp_shard"]
    policy = MixedPrecisionPolicy(reduce_dtype=REDUCE_DTYPES[reduce])
    for block in model.layers:
        fully_shard(block, mesh=device_mesh, mp_policy=policy)
    fully_shard(model, mesh=device_mesh, mp_policy=policy)  # embedding, final norm, head: the root unit
    return wrapped
