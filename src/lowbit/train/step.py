"""One training step (`train_step`): the batch's micro-batches forward and backward (or through the pipeline
schedule), the gradients' exchange and clipping, then the update, or its skip where the loss or the gradients are
not finite (nothing non-finite reaches the weights or the optimizer states); `train.rollback_after` bad steps in a
row roll back to the newest good checkpoint."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass

import torch

from lowbit.distributed import context_parallel, pipeline, tensor_parallel
from lowbit.distributed.fsdp_fp8 import precompute_amax
from lowbit.distributed.mesh import mean_over
from lowbit.distributed.tensor_parallel import sync_partial_grads
from lowbit.models.performer import redraw_features
from lowbit.numerics.scaling_state import reports_held
from lowbit.optim.memory import format_report, memory_report
from lowbit.train.compile import eager
from lowbit.train.inputs import this_rank
from lowbit.train.snapshot import rollback
from lowbit.train.state import Run


@dataclass
class StepResult:
    loss: float  # the mean over micro-batches and replicas (NaN or Inf on a skipped step)
    grad_norm: float
    lr: float  # the rate the step used
    finite: bool  # updated (else skipped)
    telemetry: bool  # the low-precision layers recorded their statistics
    telemetry_step: bool  # a telemetry step (numerics.telemetry_every)
    rolled_back: bool = False  # the run went back to a checkpoint: nothing to report


def train_step(run: Run) -> StepResult:
    """Step `run.step`: forward and backward over its batch, the update (or its skip), the schedule moved on."""
    step, n, t = run.step, run.cfg.numerics, run.cfg.train
    x, y = run.inputs.loader.batch(step - 1)
    telemetry_step = n.telemetry_every and (step % n.telemetry_every == 0 or step == 1)
    telemetry = run.lp_layers and telemetry_step
    for layer in run.lp_layers.values():
        layer.telemetry_armed = bool(telemetry)
    # Telemetry steps run eagerly: their statistics are host-side Python, which torch.compile would have
    # to break the graph for (same numerics either way).
    run_mode = eager if telemetry and t.compile else contextlib.nullcontext
    _reset_traffic(run)
    x, y = this_rank(x, y, run.par.positions)  # this rank's shard of every sequence (parallel.cp_layout)
    with dropout_stream(run):
        loss_sum = _forward_backward(run, x, y, run_mode)
    for layer in run.lp_layers.values():
        layer.telemetry_armed = False
    if run.par.sequence_parallel:
        sync_partial_grads(run.model, run.par.tp_group)
    run.par.grad_sync.sync(run.optimizer)  # the mean over replicas (nothing in a single process)
    grad_norm = run.optimizer.clip_grad_norm_(t.grad_clip or float("inf"))
    loss_value = mean_over(loss_sum, run.par.replicas).item() / run.n_micro
    lr = run.scheduler.get_last_lr()[0]
    finite = math.isfinite(loss_value) and math.isfinite(grad_norm.item())
    _update_or_skip(run, finite, loss_value)
    _after_update(run, finite)
    result = StepResult(loss_value, grad_norm.item(), lr, finite, telemetry, telemetry_step)
    if run.bad_run >= t.rollback_after:
        rollback(run)
        run.bad_run = 0
        result.rolled_back = True
        return result
    run.tokens_seen += run.tokens_per_step
    return result


@contextlib.contextmanager
def dropout_stream(run: Run):
    """The forward and backward's random stream while dropout is on: its own per replica and step
    (`dropout_seed`), forked from the run's stream, which comes back untouched afterwards. That shared stream
    stays alike on every replica, as the optimizer's stochastic rounding of replicated weights needs, and it is
    what a checkpoint keeps (rank 0's)."""
    if not run.inputs.args.dropout:
        yield
        return
    cuda = run.device.type == "cuda"
    with torch.random.fork_rng(devices=[run.device] if cuda else []):
        seed = dropout_seed(run.cfg.train.seed, run.mesh.replica[0], run.step)
        torch.default_generator.manual_seed(seed)
        if cuda:  # this process's device only: the others are other ranks'
            with torch.cuda.device(run.device):
                torch.cuda.manual_seed(seed)
        yield


def dropout_seed(seed: int, replica: int, step: int) -> int:
    """The seed of step `step`'s dropout masks on data-parallel replica `replica`: each replica its own stream
    (one shared seed would drop the same units of every replica's batch), and a function of the step rather than
    a running generator, so that a resumed or rolled-back run draws the masks the uninterrupted one drew, on
    every rank. Ranks of one replica (pipeline stages) share it; they hold different layers."""
    digest = hashlib.sha256(f"dropout/{seed}/{replica}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes a non-negative 63-bit value


def _reset_traffic(run: Run) -> None:
    """This step's traffic counted afresh."""
    run.par.grad_sync.bytes_sent = 0
    context_parallel.SENT["bytes"] = tensor_parallel.SENT["bytes"] = 0
    if run.par.zero is not None:
        run.par.zero.bytes_sent = 0


def _forward_backward(run: Run, x: torch.Tensor, y: torch.Tensor, run_mode) -> torch.Tensor:
    """The sum of the micro-batches' losses, their gradients accumulated (each scaled by 1/micro-batches)."""
    device, pipe = run.device, run.pipe
    loss_sum = torch.zeros((), device=device)
    with reports_held():  # the scaling states move on once per step, after every micro-batch
        if pipe is not None:  # the schedule runs every micro-batch through every stage, backward included
            with run.autocast(), run_mode():
                loss_sum = pipeline.run(pipe[0], pipe[1], x.to(device), y.to(device))
        for xm, ym in zip(*((x.split(run.micro), y.split(run.micro)) if pipe is None else ((), ()))):
            with run.autocast(), run_mode():
                loss = run.step_fn(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True),
                                   positions=run.par.positions)
            with run_mode():
                (loss / run.n_micro).backward()
            loss_sum += loss.detach()
    return loss_sum


def _update_or_skip(run: Run, finite: bool, loss_value: float) -> None:
    if finite:
        run.bad_run = 0
        run.optimizer.step()
        if run.par.fp8_gathered:  # the next all-gathers' scales, in one all-reduce
            precompute_amax(run.model)
        if run.par.zero is not None:  # each replica updated its share of the weights: exchange them
            run.par.zero.broadcast()
    else:  # skip the update: nothing non-finite reaches the weights or the optimizer states
        run.skipped, run.bad_run = run.skipped + 1, run.bad_run + 1
        run.say(f"lowbit: step {run.step}: non-finite {'loss' if not math.isfinite(loss_value) else 'gradients'}"
                f", update skipped ({run.bad_run} in a row, {run.skipped} in all)", flush=True)


def _after_update(run: Run, finite: bool) -> None:
    """The schedule's step, the memory report (once), gradients dropped, performer features redrawn."""
    run.scheduler.step()
    if finite and not run.memory_reported:  # measured once every tensor exists (gradients included)
        report = memory_report(run.optimizer)
        if run.lead:
            (run.run_dir / "memory.json").write_text(json.dumps(report, indent=1))
        run.metrics.track({"step": run.step, "memory": report})  # TensorBoard / W&B: memory.json's numbers
        run.say(format_report(report), flush=True)
        run.memory_reported = True
    run.optimizer.zero_grad(set_to_none=True)
    args, seed = run.inputs.args, run.cfg.train.seed
    if args.attention == "performer" and args.performer_redraw and run.step % args.performer_redraw == 0:
        redraw_features(run.model, seed=seed * 1_000_003 + run.step)  # a function of the step: resumes exactly
