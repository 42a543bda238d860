"""The run's layout applied around a built model: `parallelize` shards the model for the mesh (context parallel
attention, tensor and sequence parallel linears, the pipeline split, FSDP2) and returns what training needs of it
afterwards (`Parallel`); `parallelize_optimizer` hands the optimizer its groups and ZeRO-1 its share;
`pipeline_schedules` builds a stage's training and validation schedules.

The model stays plain PyTorch until here, and converted (numerics) before: every piece below acts on a Llama in
place, in the order the trainer has always applied them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.distributed import pipeline
from lowbit.distributed.context_parallel import apply_context_parallel, shard_positions
from lowbit.distributed.fsdp import apply_fsdp
from lowbit.distributed.grad_sync import GradSync
from lowbit.distributed.tensor_parallel import apply_sequence_parallel, apply_tensor_parallel
from lowbit.distributed.zero import Zero1


@dataclass
class Parallel:
    """What a parallelized model leaves the training step: its groups (None where a dimension has one member),
    the context-parallel positions, the pipeline stage, and the gradient exchange."""

    replicas: object  # ranks whose gradients and losses are averaged (dp × dp_shard × cp)
    tp_group: object
    pp_group: object
    positions: torch.Tensor | None  # this rank's positions in the sequence, under context parallelism
    stage: pipeline.StageModule | None  # this rank's pipeline stage
    fsdp: bool  # FSDP2 averages the gradients itself (in its reduce-scatter)
    fp8_gathered: list[str]  # weights FSDP2 all-gathers as FP8 bytes
    grad_sync: GradSync
    sequence_parallel: bool
    zero: Zero1 | None = field(default=None)  # set by parallelize_optimizer


def parallelize(model: torch.nn.Module, mesh, parallel, seq_len: int, device: torch.device) -> Parallel:
    """Apply `parallel` (the config's [parallel]) to `model` over `mesh`: context parallelism, tensor parallelism
    (then sequence parallelism), the pipeline split, FSDP2; then the replicas' gradient exchange."""
    replicas = mesh.group("dp", "dp_shard", "cp")
    fsdp = mesh.sizes["dp_shard"] > 1
    positions = None
    if mesh.sizes["cp"] > 1:
        layout = parallel.cp_layout
        apply_context_parallel(model, mesh.group("cp"), seq_len, parallel.cp_impl, layout, parallel.cp_kv_dtype)
        positions = shard_positions(seq_len, mesh.sizes["cp"], mesh.coords["cp"], layout).to(device)
    tp_group = mesh.group("tp")
    if tp_group is not None:
        apply_tensor_parallel(model, tp_group)
        if parallel.sequence_parallel:
            apply_sequence_parallel(model, tp_group)
    pp_group = mesh.group("pp")
    stage = pipeline.split_model(model, mesh.sizes["pp"], mesh.coords["pp"]) if pp_group is not None else None
    fp8_gathered: list[str] = []
    if fsdp:
        fp8_gathered = apply_fsdp(model, mesh, parallel.grad_sync, parallel.fsdp_fp8_gather)
    grad_sync = GradSync(None if fsdp else replicas, parallel.grad_sync, parallel.grad_sync_format,
                         parallel.grad_scaling)
    return Parallel(replicas, tp_group, pp_group, positions, stage, fsdp, fp8_gathered, grad_sync,
                    parallel.sequence_parallel)


def parallelize_optimizer(optimizer, par: Parallel, mesh, parallel) -> None:
    """The groups clipping sums norms over (tp shards, pipeline stages, FSDP shards), and ZeRO-1 over the
    replicas where `parallel.zero` asks (`par.zero`)."""
    optimizer.shard_group, optimizer.stage_group = par.tp_group, par.pp_group
    optimizer.fsdp_group = mesh.group("dp_shard")
    par.zero = Zero1(optimizer, par.replicas) if parallel.zero and par.replicas is not None else None


def pipeline_schedules(par: Parallel, mesh, device: torch.device, n_micro: int, kind: str):
    """(training pipe, validation pipes) of a pipeline stage, or (None, None). The training pipe is (schedule,
    stage, micro-batches); validation batches are single micro-batches, and as a stage runs one batch shape per
    schedule, `validation(b)` gives the pipe for a batch of b sequences (a smaller last batch gets its own)."""
    if par.stage is None:
        return None, None
    pp, coord = mesh.sizes["pp"], mesh.coords["pp"]
    pipes = {}

    def validation(b: int) -> tuple:
        if b not in pipes:
            pipes[b] = (pipeline.build_schedule(par.stage, coord, pp, device, par.pp_group, 1, "gpipe"), par.stage, 1)
        return pipes[b]

    return (pipeline.build_schedule(par.stage, coord, pp, device, par.pp_group, n_micro, kind), par.stage,
            n_micro), validation
