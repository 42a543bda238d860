"""`Run`: the live objects of one training run (config, mesh, model, optimizer, schedule, metrics) and its counters
(step, tokens seen, bad steps), which the step, validation and checkpoint functions read and move on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lowbit.distributed.mesh import Mesh
    from lowbit.distributed.parallelize import Parallel
    from lowbit.optim import LowbitAdamW
    from lowbit.train.config import Config
    from lowbit.train.inputs import Inputs


@dataclass
class Run:
    """One run's live objects, built once by the trainer, and its counters, moved on by each step."""

    cfg: Config
    recipe: Any
    device: torch.device
    dtype: torch.dtype
    mesh: Mesh
    inputs: Inputs
    model: torch.nn.Module
    model_keys: set[str]  # the whole model's state keys, before any split: what a checkpoint must hold
    flops_per_token: float  # the whole model's
    par: Parallel
    lp_layers: dict  # name -> LowPrecisionLinear, named before any compilation
    optimizer: LowbitAdamW
    scheduler: Any
    # set once restored, compiled and its files opened
    step_fn: Any = None  # the model, compiled where train.compile asks
    metrics: Any = None  # Metrics on rank 0, a silent stand-in elsewhere
    param_names: dict | None = None  # parameter -> name on rank 0 (optimizer-state telemetry)
    micro: int = 0  # micro-batch size, per replica
    n_micro: int = 0
    pipe: tuple | None = None  # (schedule, stage, micro-batches) of a pipeline stage
    eval_pipe: object = None  # parallelize.pipeline_schedules' validation(b), under pipeline parallelism
    # counters
    start_step: int = 0
    step: int = 0
    tokens_seen: int = 0
    skipped: int = 0  # steps skipped for non-finite loss or gradients, in all
    bad_run: int = 0  # ... in a row
    memory_reported: bool = False
    rolled_back_to: set[Path] = field(default_factory=set)
    summary: dict = field(default_factory=dict)

    @property
    def lead(self) -> bool:
        return self.mesh.rank == 0

    def say(self, *args, **kwargs) -> None:
        """Print on rank 0 only."""
        if self.lead:
            print(*args, **kwargs)

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run.dir)

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.batch_size * self.cfg.data.seq_len

    @property
    def last_step(self) -> int:
        return self.cfg.train.stop_at or self.cfg.train.steps

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)
