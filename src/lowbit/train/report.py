"""What a training step reports: its metrics record (loss, lr, norm, tokens, traffic, skips), every
`train.log_every` steps the progress line (tokens/s, MFU, ETA, timed by a `Clock` that leaves out the first step,
validation and checkpoints), and the numerics and optimizer-state telemetry records."""

from __future__ import annotations

import contextlib
import math
import time

import torch

from lowbit.distributed import context_parallel, tensor_parallel
from lowbit.train.metrics import gpu_peak_flops, progress_line
from lowbit.train.state import Run
from lowbit.train.step import StepResult


def _finite_or_none(v: float) -> float | None:
    """JSON has no NaN: a skipped step's loss or norm is written as null."""
    return v if math.isfinite(v) else None


class Clock:
    """Tokens/s, MFU and the time per step, from the step after `first_step` on (the first pays for compilation
    and warm-up), with the time `paused()` kept out."""

    def __init__(self, run: Run):
        self.first_step, self.tokens_per_step = run.start_step + 1, run.tokens_per_step
        self.peak = gpu_peak_flops(run.device) if run.dtype == torch.bfloat16 else None
        self.flops_per_step = run.flops_per_token * run.tokens_per_step / run.mesh.world  # per process: MFU is per GPU
        self.window_t0, self.window_tokens, self.run_t0, self.timed_steps = time.perf_counter(), 0, None, 0

    def restart_window(self) -> None:
        self.window_t0, self.window_tokens = time.perf_counter(), 0

    def stepped(self, step: int) -> None:
        self.window_tokens += self.tokens_per_step
        if step == self.first_step:  # the first step pays for compilation and warm-up: time from here on
            self.run_t0, self.window_t0, self.window_tokens = time.perf_counter(), time.perf_counter(), 0
        else:
            self.timed_steps += 1

    def lap(self) -> tuple[float, float | None, float]:
        """(tokens/s, MFU or None, seconds per step) since the last lap; a new window starts."""
        now = time.perf_counter()
        tps = self.window_tokens / max(now - self.window_t0, 1e-9)
        mfu = tps / self.tokens_per_step * self.flops_per_step / self.peak if self.peak else None
        per_step = (now - self.run_t0) / max(self.timed_steps, 1)
        self.window_t0, self.window_tokens = now, 0
        return tps, mfu, per_step

    @contextlib.contextmanager
    def paused(self):
        """Validation and checkpoints are kept out of tokens/s and the ETA."""
        pause_t0 = time.perf_counter()
        yield
        paused = time.perf_counter() - pause_t0
        self.window_t0 += paused
        if self.run_t0 is not None:
            self.run_t0 += paused


def traffic(run: Run) -> dict:
    """This step's bytes sent, in all and by kind ({} in a single process)."""
    if run.mesh.world == 1:
        return {}
    zero, grad_bytes = run.par.zero, run.par.grad_sync.bytes_sent
    cp_bytes, tp_bytes = context_parallel.SENT["bytes"], tensor_parallel.SENT["bytes"]
    return {"comm_bytes": grad_bytes + cp_bytes + (zero.bytes_sent if zero is not None else 0) + tp_bytes,
            "comm_bytes_tp": tp_bytes, "comm_bytes_grad": grad_bytes, "comm_bytes_cp": cp_bytes,
            **({"comm_bytes_zero": zero.bytes_sent} if zero is not None else {})}


def report_step(run: Run, result: StepResult, clock: Clock) -> None:
    """The step's records in metrics.jsonl, the progress line when due, the summary moved on."""
    step, t = run.step, run.cfg.train
    record = {"step": step, "loss": _finite_or_none(result.loss), "lr": result.lr,
              "grad_norm": _finite_or_none(result.grad_norm), "tokens": run.tokens_seen, **traffic(run),
              **({"skipped": not result.finite, "skipped_steps": run.skipped} if run.skipped else {})}
    clock.stepped(step)
    if step % t.log_every == 0 or step == run.last_step:
        tps, mfu, per_step = clock.lap()
        peak_gib = torch.cuda.max_memory_allocated(run.device) / 2**30 if run.device.type == "cuda" else None
        record.update(tokens_per_s=tps, **({"mfu": mfu} if mfu is not None else {}),
                      **({"peak_mem_gib": peak_gib} if peak_gib is not None else {}))
        run.say(progress_line(step, t.steps, result.loss, result.lr, tps, mfu, per_step * (run.last_step - step),
                              peak_gib), flush=True)
    run.metrics.log(record)
    if result.telemetry:
        run.metrics.log({"step": step, "numerics": {name: dict(layer.telemetry)
                                                    for name, layer in run.lp_layers.items()}})
    if run.lead and result.telemetry_step:
        states = run.optimizer.state_telemetry(run.param_names)  # {} unless a moment is stored in a scaled kind
        if states:
            run.metrics.log({"step": step, "optim_states": states})
    run.summary.update(step=step, loss=_finite_or_none(result.loss))
