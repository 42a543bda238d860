"""Pipeline parallelism with torch.distributed.pipelining: the blocks are cut into pp contiguous stages (the
embedding on the first, the final norm and the head on the last); GPipe or 1F1B over the micro-batches of each
replica's batch (`train.micro_batch_size` sets how many).

Each stage keeps its own blocks under their global names (the others become nn.Identity), so state-dict keys are
the whole model's: a stage writes its part of a checkpoint and reads its part of any other.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowbit.errors import LowbitError


def stage_blocks(n_layers: int, pp: int, stage: int) -> range:
    """Contiguous blocks of `stage`: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class StageModule(nn.Module):
    """What one stage computes: tokens -> hidden (first), hidden -> hidden, hidden -> logits (last)."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool):
        super().__init__()
        self.model, self.blocks, self.first, self.last = model, blocks, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        h = m.tok_embeddings(x) if self.first else x
        cos, sin = m.rope_cos[:h.shape[1]], m.rope_sin[:h.shape[1]]
        for i in self.blocks:
            h = m.layers[i](h, cos, sin)
        return m.output(m.norm(h)) if self.last else h


def split_model(model: nn.Module, pp: int, stage: int) -> StageModule:
    if model.args.tie_embeddings:
        raise LowbitError("parallel.pp: tied input and output embeddings would live on two stages; set "
                          "model.tie_embeddings false")
    blocks = stage_blocks(len(model.layers), pp, stage)
    for i in range(len(model.layers)):
        if i not in blocks:
            model.layers[i] = nn.Identity()
    first, last = stage == 0, stage == pp - 1
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm, model.output = None, None
    return StageModule(model, blocks, first, last)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build_schedule(module: StageModule, stage: int, pp: int, device, group, n_micro: int, kind: str):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    st = PipelineStage(module, stage, pp, device, group=group)
    # Not zero-bubble schedules: they split backward by `inputs=`, which skips the scaling states' report sinks
    return (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(st, n_micro, loss_fn=loss_fn)


def run(schedule, module: StageModule, x, y, train: bool = True) -> torch.Tensor:
    """One pass over a replica's batch; returns the sum of the micro-batch losses on every stage."""
    losses = []
    step = schedule.step if train else schedule.eval
    args = (x,) if module.first else ()
    kwargs = dict(target=y, losses=losses) if module.last else {}
    step(*args, **kwargs)
    total = torch.stack([l.detach().float() for l in losses]).sum() if module.last else \
        torch.zeros((), device=x.device)
    dist.all_reduce(total, group=schedule._stage.group)
    return total
