"""A live run's checkpoints: what `save_checkpoint` writes of it (every process its pieces, rank 0 the small
state), what `restore` reads back into it in place (on resume, and on `rollback` to the newest good checkpoint
after K bad steps in a row). The directory format itself is train/checkpoint.py's."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import torch

from lowbit.distributed.fsdp_fp8 import precompute_amax
from lowbit.distributed.mesh import lead_first
from lowbit.distributed.sharded_state import checkpoint_tensors
from lowbit.errors import LowbitError
from lowbit.train import checkpoint as ckpt
from lowbit.train.config import to_dict
from lowbit.train.state import Run


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate((3, tuple(state["python"]), None))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


def save_checkpoint(run: Run, step: int) -> Path:
    """Checkpoint `step` of the live run (every process its pieces); returns its directory."""
    inputs, mesh = run.inputs, run.mesh
    state = {"optimizer": run.optimizer.hyper(), "scheduler": run.scheduler.state_dict(),
             "rng": _rng_state(run.device), "grad_sync": run.par.grad_sync.state_dict()}
    # Prepared data: the position is the step (the order is a pure function of (seed, step)); a stream's
    # position is where its next window starts.
    info = {"step": step, "tokens_seen": run.tokens_seen, "data_position": inputs.loader.position(step),
            "model_args": dataclasses.asdict(inputs.args),
            "tokenizer_hash": inputs.dataset.meta["tokenizer_hash"], "recipe": run.recipe.name,
            "config": to_dict(run.cfg), "dataset": str(inputs.data_path), "layout": dict(mesh.sizes)}
    # Every process writes its pieces; rank 0 makes the directory, then finishes it (its small files are
    # the same on every rank). Its errors reach every rank, and nobody reads a half-written checkpoint.
    run_dir, lead = run.run_dir, run.lead
    tmp = lead_first(mesh, lambda: ckpt.begin(run_dir, step, lead))
    try:
        ckpt.write_tensors(tmp, checkpoint_tensors(run.model, run.optimizer, mesh))
    except BaseException:  # every rank gets DCP's error; rank 0 removes the half-written directory
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return lead_first(mesh, lambda: ckpt.commit(run_dir, step, tmp, state, info, run.cfg.checkpoint.keep)
                      if lead else ckpt.checkpoint_root(run_dir) / f"{ckpt.PREFIX}{step:08d}")


def restore(run: Run, path: Path, loaded) -> tuple[int, int]:
    """Read checkpoint `path` (its `loaded` state and info) into the live run; returns (step, tokens seen)."""
    state, info = loaded
    optimizer = run.optimizer
    optimizer.load_hyper(state["optimizer"])  # same groups, stored alike: checked before any tensor is read
    # this process's pieces of the whole tensors, read in place (a stage's blocks, a tp shard, a ZeRO share)
    ckpt.load_tensors(path, checkpoint_tensors(run.model, optimizer, run.mesh), run.model_keys)
    if run.par.fp8_gathered:  # loaded under the FP8 all-gather's bookkeeping: its amaxes are measured afresh
        precompute_amax(run.model)
    run.scheduler.load_state_dict(state["scheduler"])
    if "grad_sync" in state:
        run.par.grad_sync.load_state_dict(state["grad_sync"])
    _set_rng_state(state["rng"], run.device)
    run.inputs.loader.seek(info.get("data_position") or {"batch": info["step"]})
    return info["step"], info["tokens_seen"]


def rollback(run: Run) -> None:
    """Back to the newest good checkpoint, once per checkpoint: a deterministic replay that fails again
    would only loop. Moves the run's step and tokens seen back."""
    t, run_dir, bad_step = run.cfg.train, run.run_dir, run.step
    good = ckpt.find_resumable(run_dir) if ckpt.list_checkpoints(run_dir) else None
    if good is None or good in run.rolled_back_to:
        raise LowbitError(f"{t.rollback_after} consecutive steps with non-finite gradients up to step {bad_step}"
                          f"; {'no checkpoint to roll back to' if good is None else f'already rolled back to {good} once'}"
                          f" (lower train.lr or raise train.warmup_steps; checkpoint.every sets the rollback points)")
    run.rolled_back_to.add(good)
    back = restore(run, good, ckpt.load_state(good))
    run.say(f"lowbit: {t.rollback_after} consecutive bad steps up to step {bad_step}: rolled back to {good} "
            f"(step {back[0]})", flush=True)
    run.metrics.truncate_after(back[0])  # the steps after it are redone
    run.metrics.log({"step": back[0], "rollback": {"from": bad_step, "to": back[0], "checkpoint": str(good)}})
    run.step, run.tokens_seen = back
