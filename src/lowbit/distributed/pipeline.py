"""Pipeline parallelism with torch.distributed.pipelining: the blocks are cut into pp contiguous stages (the
embedding on the first, the final norm and the head on the last); GPipe or 1F1B over the micro-batches of each
replica's batch (`train.micro_batch_size` sets how many).

Each stage keeps its own blocks under their global names (the others become nn.Identity), so state-dict keys are
the whole model's. Checkpoints are whole: `full_state` gathers every stage's tensors and renumbers the optimizer
state as one process would hold it; `stage_state` takes a stage's part back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowbit.distributed.zero import _pack, _unpack
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
            h = m.run_block(m.layers[i], h, cos, sin)
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


# ---- whole checkpoints ----

def _names(model, optimizer) -> list[list[str]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]


def full_state(model, optimizer, group, model_state: dict, opt_state: dict) -> tuple[dict, dict]:
    """Every stage's tensors, the optimizer renumbered as one process holds it (groups in order, each group's
    parameters stage after stage, which is the model's order)."""
    names = _names(model, optimizer)
    mine = {"model": {k: _pack(v) for k, v in model_state.items()}, "names": names,
            "state": {names_flat: {k: _pack(v) for k, v in opt_state["state"][i].items()}
                      for i, names_flat in enumerate(n for g in names for n in g) if i in opt_state["state"]},
            "groups": opt_state["param_groups"]}
    shares = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, mine, group=group)
    device = next(iter(model_state.values())).device
    whole_model = {k: _unpack(v, device) for s in shares for k, v in s["model"].items()}
    order = [[n for s in shares for n in s["names"][g]] for g in range(len(names))]
    states = {n: st for s in shares for n, st in s["state"].items()}
    index, state, groups = 0, {}, []
    for g, group_names in enumerate(order):
        groups.append(dict(shares[0]["groups"][g], params=list(range(index, index + len(group_names)))))
        for n in group_names:
            if n in states:
                state[index] = {k: _unpack(v, device) for k, v in states[n].items()}
            index += 1
    return whole_model, {"state": state, "param_groups": groups}


def stage_state(model, optimizer, group, model_state: dict, opt_state: dict) -> tuple[dict, dict]:
    """This stage's part of a whole checkpoint."""
    names = _names(model, optimizer)
    shares = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, names, group=group)
    order = [n for g in range(len(names)) for s in shares for n in s[g]]
    global_index = {n: i for i, n in enumerate(order)}
    own_keys = set(model.state_dict())
    local_state, groups, index = {}, [], 0
    for g, group_names in enumerate(names):
        groups.append(dict(opt_state["param_groups"][g], params=list(range(index, index + len(group_names)))))
        for n in group_names:
            if global_index[n] in opt_state["state"]:
                local_state[index] = opt_state["state"][global_index[n]]
            index += 1
    return {k: v for k, v in model_state.items() if k in own_keys}, {"state": local_state, "param_groups": groups}
