"""The device mesh: pp × dp × dp_shard × cp × tp processes, launched by torchrun (NCCL on GPUs, gloo on CPUs).

Every check that can fail is made before any collective (`check_layout`, from the run's plan), so a bad layout
is a one-line error on every rank rather than a hang; collectives carry `parallel.timeout_s`.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowbit.errors import LowbitError

DIMS = ("pp", "dp", "dp_shard", "cp", "tp")  # outermost first: tp neighbours get the closest ranks (NVLink)
REPLICAS = ("dp", "dp_shard")  # each takes its own slice of the global batch


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(cfg, args, precision) -> None:
    """Layout errors, on every rank alike (pure arithmetic on the config and the environment). `precision`: the
    covered weights' StatePrecision (the resolved recipe's)."""
    p, t = cfg.parallel, cfg.train
    product = p.pp * p.dp * p.dp_shard * p.cp * p.tp
    if product != world_size():
        raise LowbitError(f"parallel: dp*dp_shard*tp*pp*cp = {p.dp}*{p.dp_shard}*{p.tp}*{p.pp}*{p.cp} = {product}, "
                          f"but {world_size()} process(es) run (torchrun --nproc-per-node sets it)")
    if p.dp_shard > 1:
        _check_fsdp(cfg, precision)
    if p.pp > 1 and p.cp > 1:
        raise LowbitError("parallel.pp: pipeline and context parallelism together are not implemented yet")
    if p.pp > 1 and args.tie_embeddings:
        raise LowbitError("parallel.pp: tied input and output embeddings would live on two stages; set "
                          "--model.tie_embeddings false")
    if p.tp > 1:
        for what, n in (("model.n_heads", args.n_heads), ("model.n_kv_heads", args.n_kv_heads),
                        ("model.ffn_dim", args.ffn_dim)):
            if n % p.tp:
                raise LowbitError(f"parallel.tp ({p.tp}) must divide {what} ({n})")
        if _low_precision_states(precision):
            raise LowbitError(f"parallel.tp: recipe {cfg.recipe} keeps optimizer states in low precision, which "
                              f"tensor parallelism does not shard yet (fp32 states only)")
    if p.sequence_parallel and (p.tp == 1 or cfg.data.seq_len % p.tp or p.cp > 1):
        raise LowbitError(f"parallel.sequence_parallel: needs parallel.tp > 1 dividing data.seq_len "
                          f"({cfg.data.seq_len}), and no parallel.cp")
    zigzag = p.cp_layout == "zigzag"
    if p.cp > 1 and cfg.data.seq_len % ((1 + zigzag) * p.cp):
        raise LowbitError(f"data.seq_len ({cfg.data.seq_len}) must be divisible by "
                          + (f"2*parallel.cp ({2 * p.cp}): each rank takes two zigzag chunks" if zigzag else
                             f"parallel.cp ({p.cp}): each rank takes one chunk (parallel.cp_layout plain)"))
    if p.cp_kv_dtype != "auto" and p.cp == 1:
        raise LowbitError(f"parallel.cp_kv_dtype ({p.cp_kv_dtype}): K/V travel only under context parallelism; "
                          f"set parallel.cp > 1 or leave it auto")
    if p.cp > 1 and args.attention != "sdpa":
        raise LowbitError(f"parallel.cp: context parallelism computes exact attention; model.attention "
                          f"{args.attention} is not supported with it")
    if p.cp > 1 and args.sdpa_backend != "auto":
        raise LowbitError(f"model.sdpa_backend ({args.sdpa_backend}): context parallelism (parallel.cp) computes "
                          f"attention with its own kernels; leave it auto")
    if p.pp > args.n_layers:
        raise LowbitError(f"parallel.pp ({p.pp}) is larger than the number of blocks ({args.n_layers})")
    replicas = p.dp * p.dp_shard
    if t.batch_size % replicas:
        raise LowbitError(f"train.batch_size ({t.batch_size}) must be divisible by parallel.dp * parallel.dp_shard "
                          f"({replicas})")
    if t.micro_batch_size and (t.batch_size // replicas) % t.micro_batch_size:
        raise LowbitError(f"train.micro_batch_size ({t.micro_batch_size}) must divide the per-replica batch "
                          f"(train.batch_size / (parallel.dp * parallel.dp_shard) = {t.batch_size // replicas})")
    local = t.batch_size // replicas
    n_micro = local // micro_batch(cfg, local)
    if p.pp > 1 and n_micro < p.pp:
        fits = [d for d in range(local // p.pp, 0, -1) if local % d == 0]
        raise LowbitError(f"train.micro_batch_size: a pipeline of {p.pp} stages needs at least {p.pp} micro-batches "
                          f"per replica, but {local} sequence(s) make {n_micro}; "
                          + (f"set --train.micro_batch_size {fits[0]}" if fits else
                             f"raise train.batch_size to {p.pp * replicas} or more"))


def micro_batch(cfg, local_batch: int) -> int:
    """Sequences per micro-batch: train.micro_batch_size, else the replica's whole batch, or under pipeline
    parallelism (which needs a micro-batch per stage at least) the batch split in parallel.pp where it divides."""
    pp = cfg.parallel.pp
    if cfg.train.micro_batch_size:
        return cfg.train.micro_batch_size
    return local_batch // pp if pp > 1 and local_batch % pp == 0 else local_batch


def _low_precision_states(prec) -> bool:
    """Whether a StatePrecision keeps anything below fp32."""
    return (prec.weights, prec.master, prec.grads, prec.exp_avg, prec.exp_avg_sq) != ("fp32", "none", "fp32",
                                                                                      "fp32", "fp32")


def _check_fsdp(cfg, precision) -> None:
    """What FSDP2 (parallel.dp_shard) does not combine with yet: one line naming the first conflict."""
    p = cfg.parallel
    others = [f"parallel.{d} {getattr(p, d)}" for d in ("tp", "pp", "cp") if getattr(p, d) > 1]
    if p.zero:
        others.append("parallel.zero (FSDP shards the optimizer states already)")
    if others:
        raise LowbitError(f"parallel.dp_shard: FSDP2 does not combine with {others[0]} yet (dp for HSDP only)")
    if p.grad_sync == "fp8":
        raise LowbitError("parallel.dp_shard: FSDP2 reduce-scatters gradients in fp32 or bf16 "
                          "(parallel.grad_sync fp32 | bf16), not fp8")
    if _low_precision_states(precision):
        raise LowbitError(f"parallel.dp_shard: recipe {cfg.recipe} keeps weights or optimizer states in low "
                          f"precision, which FSDP2 does not shard yet (fp32 states only)")


@dataclass
class Mesh:
    """Where this process sits. `group(dims)` is None in a single process."""

    sizes: dict[str, int]
    coords: dict[str, int]
    device_mesh: object = None  # torch DeviceMesh when world > 1

    @property
    def world(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def replica(self) -> tuple[int, int]:
        """(this process's replica, the number of replicas): dp × dp_shard, each with its own batch slice."""
        return (self.coords["dp"] * self.sizes["dp_shard"] + self.coords["dp_shard"],
                self.sizes["dp"] * self.sizes["dp_shard"])

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.world > 1 else 0

    def group(self, *dims: str):
        """The process group spanning `dims` (e.g. "dp", "cp"), or None if it has a single member."""
        if self.device_mesh is None or all(self.sizes[d] == 1 for d in dims):
            return None
        if len(dims) == 1:
            return self.device_mesh[dims[0]].get_group()
        return self.device_mesh[dims]._flatten("_".join(dims)).get_group()


def single() -> Mesh:
    return Mesh({d: 1 for d in DIMS}, {d: 0 for d in DIMS})


def init_mesh(parallel, device: torch.device) -> Mesh:
    """Join the process group torchrun set up (env://) and build the mesh; a single process needs neither."""
    sizes = {d: getattr(parallel, d) for d in DIMS}
    if world_size() == 1:
        return single()
    from torch.distributed.device_mesh import init_device_mesh

    global _OWN_GROUP
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=parallel.timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
        _OWN_GROUP = True
    mesh = init_device_mesh(device.type, tuple(sizes[d] for d in DIMS), mesh_dim_names=DIMS)
    return Mesh(sizes, {d: mesh.get_local_rank(d) for d in DIMS}, mesh)


_OWN_GROUP = False  # whether init_mesh started the process group (a caller's own group is left to the caller)


def shutdown() -> None:
    """End the process group init_mesh started, after a run that finished on every rank (NCCL warns otherwise)."""
    global _OWN_GROUP
    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP = False


def local_device(requested: torch.device) -> torch.device:
    """Under torchrun each process takes the GPU of its local rank."""
    if requested.type == "cuda" and world_size() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return requested


def lead_first(mesh: Mesh, fn):
    """Run `fn` on rank 0 first (it may write: a dataset cache, the run directory), then on the others; a
    LowbitError on rank 0 is raised on every rank instead of leaving them waiting."""
    if mesh.world == 1:
        return fn()
    result, error = None, None
    if mesh.rank == 0:
        try:
            result = fn()
        except LowbitError as e:
            error = str(e)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise LowbitError(box[0] if mesh.rank == 0 else f"(rank 0) {box[0]}")
    return result if mesh.rank == 0 else fn()


def mean_over(x: torch.Tensor, group) -> torch.Tensor:
    """The mean of `x` over the ranks of `group` (x itself without one)."""
    if group is None:
        return x
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x / dist.get_world_size(group)
