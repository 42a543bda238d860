"""The scaling state of one GEMM operand, and the recording of what its casts saw: `ScalingState` (scale, amax
history and counters in buffers, so checkpoints carry them), `OperandStates` (one linear's three states and the
sink its backward reports through), and the batched recording of those reports at the end of a backward pass.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from lowbit.backward_end import at_backward_end
from lowbit.numerics.scaling import Scaling, all_max, current_scale, group_amax, scale_from_amax


class ScalingState(nn.Module):
    """Per-operand state, in buffers so that state_dict() and checkpoints carry it.

    scale        delayed: the scale of the next cast; current: the last good one (the fallback of the output
                 gradient's cast and of FSDP's FP8 weight gather)
    amax_history most recent first (delayed); the last amax (current)
    updates      how many amaxes were recorded
    skipped      how many bad amaxes (0, NaN, Inf) were seen
    """

    def __init__(self, s: Scaling):
        super().__init__()
        self.spec = s
        self.register_buffer("scale", torch.ones(()))
        self.amax_group = None  # a process group whose ranks hold shards of this tensor (set by tensor parallelism)
        self.register_buffer("amax_history", torch.zeros(s.history if s.strategy == "delayed" else 1))
        self.register_buffer("updates", torch.zeros((), dtype=torch.int64))
        self.register_buffer("skipped", torch.zeros((), dtype=torch.int64))

    def extra_repr(self) -> str:
        s = self.spec
        extra = (f", history={s.history}, algo={s.algo}, interval={s.interval}"
                 + (f", warmup={s.warmup}" if s.warmup else "")) if s.strategy == "delayed" else ""
        return f"{s.fmt}, {s.granularity}, {s.strategy}{extra}, margin={s.margin}"

    @torch.no_grad()
    def scales_for(self, x: torch.Tensor, update: bool) -> torch.Tensor:
        """The scale(s) to cast `x` with, in group_amax's layout; records the cast now when `update` (a
        standalone cast, `qtensor.quantize`; LowPrecisionLinear reports its casts after backward instead)."""
        scale, report = self.cast_scale(x)
        if update:
            self.observe(report[0], report[1])
        return scale

    @torch.no_grad()
    def cast_scale(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, report): the scale(s) to cast `x` with, and [amax (tensor granularity; else 0), bad groups] to
        record (`observe`) later: LowPrecisionLinear returns it at the end of the backward pass, through its
        sink (`OperandStates`). The state is only read here, and a current scale not even that: it depends on `x`
        alone (`current_scale`), so a compiled forward takes no state of it and writes none. Until the report
        is recorded, a delayed scale stays the one this forward read, so that a forward recomputed by activation
        checkpointing (eager or compiled, where a replay cannot be told apart) casts the same."""
        s = self.spec
        if s.strategy == "current":
            scale, amax, bad = current_scale(x, s, self.amax_group)
        else:
            amax = group_amax(x, s)
            if self.amax_group is not None:
                amax = all_max(amax, self.amax_group)
            # delayed: cast with the scale derived from past steps; the amax joins the history later. With no
            # history yet (the first step), cast with the current amax instead of TransformerEngine's initial
            # scale of 1, which flushes nearly every gradient of the first step to zero.
            current, bad = scale_from_amax(amax, s, fallback=self.scale)
            scale = torch.where(self.warming_up(), current, self.scale)
        return scale, report(amax if s.granularity == "tensor" else None, bad)

    def warming_up(self) -> torch.Tensor:
        """Delayed: whether the next cast takes its own amax. Always before the first update; with `warmup`, also
        while one of the last `warmup` recorded amaxes was bad or is yet to come (the window records those as 0,
        and starts as zeros), so a window never scales by a stale or missing amax. Read from the window itself: no
        state beyond it, and a checkpoint resumes mid-warm-up."""
        first = self.updates == 0
        n = min(self.spec.warmup, self.spec.history)
        return first | (self.amax_history[:n] == 0).any() if n else first

    def observe(self, amax: torch.Tensor, bad_groups: torch.Tensor) -> None:
        """Record one cast: `amax` (tensor granularity) and how many groups had a bad amax. Delayed: the amax
        joins the window (`record_all`); current: the scale it gives (or the last good one) is kept."""
        tensor = self.spec.granularity == "tensor"  # amax and scale are recorded for one scale per tensor only
        observe_all([self], amax.reshape(1) if tensor else None, bad_groups.reshape(1))


def report(amax: torch.Tensor | None, bad: torch.Tensor) -> torch.Tensor:
    """[amax, bad groups] of one cast, as fp32 (amax 0 where there is no one amax per tensor)."""
    bad = bad.sum().float().reshape(1)
    return torch.cat([amax.float().reshape(1) if amax is not None else torch.zeros_like(bad), bad])


class OperandStates(nn.ModuleDict):
    """The ScalingStates of one linear's operands (input, weight, grad_output), and the sink through which one
    backward reports what its layer cast, all three at once: the autograd Function returns their reports, a
    [3, 2] tensor, as the sink's gradient, and a hook queues it once autograd has accumulated it, for
    `record_reports` at the end of the backward pass (a backward that does not accumulate into it,
    `torch.autograd.grad`, reports nothing). The forward and backward themselves stay free of side effects, so
    torch.compile keeps each in one graph, with no state of a current cast among its inputs or outputs. (One
    sink per layer, not per operand: each sink is a gradient the compiled backward returns and a hook the engine
    calls; with two more per layer, fp8-delayed's backward took the H200's host 26 ms more than fp8-tensorwise's
    at `1b`.)"""

    def __init__(self, states: dict[str, ScalingState]):
        super().__init__(states)
        if states:  # an empty one (no operand scaled) has nothing to report
            self.sink(next(iter(states.values())).scale.device)

    def sink(self, device: torch.device) -> torch.Tensor:
        """The leaf tensor whose gradient carries this layer's reports. (Made with the module and on every move:
        a compiled region cannot create a tensor that requires grad.)"""
        sink = self.__dict__.get("_sink")
        if sink is None or sink.device != torch.device(device):
            sink = torch.zeros(len(self), 2, device=device, requires_grad=True)
            sink.register_post_accumulate_grad_hook(self._observed)
            self.__dict__["_sink"] = sink
        return sink

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        if len(self):
            self.sink(next(iter(self.values())).scale.device)
        return out

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_sink", None)  # its hook records into these states: a copy makes its own on first use
        return state

    def _observed(self, sink: torch.Tensor) -> None:
        # A layer run n times in one backward gets its n reports summed by autograd: the amax recorded is then
        # the sum (too large: a smaller scale, never an overflow). lowbit's models run each layer once.
        g, sink.grad = sink.grad, None
        _REPORTS.extend(zip(self.values(), g.unbind()))
        if not _HELD[0]:
            at_backward_end(record_reports)


# Backward reports wait here for the end of their backward pass, then are recorded together: one state's record
# is about 25 small kernels, and launching them eagerly for every linear starved the GPU (fp8lm at 1b: 100 ms of
# a 285 ms step idle). Batched, a step's reports cost a few dozen launches per distinct Scaling.
_REPORTS: list[tuple[ScalingState, torch.Tensor]] = []  # (state, [amax, bad groups])
_HELD = [0]  # depth of `reports_held` blocks


@contextlib.contextmanager
def reports_held():
    """Within: backward reports wait for the end of the block, then are recorded (the trainer's step: every
    micro-batch, in whatever order a pipeline schedule runs their forwards and backwards). Every micro-batch of
    the step then casts with the scales the step began with, so a pipeline computes what one process does."""
    _HELD[0] += 1
    try:
        yield
    finally:
        _HELD[0] -= 1
        if not _HELD[0]:
            record_reports()


@torch.no_grad()
def record_reports() -> None:
    """Record the backward reports waiting in `_REPORTS`, batched per (Scaling, device). Runs when the backward
    pass that made them ends, or when `reports_held` exits (a pass that raised leaves its reports to the next
    one's end); call it to record them earlier."""
    reports = list(_REPORTS)
    _REPORTS.clear()
    while reports:  # in rounds, a state at most once per round (twice: a backward that raised left one), in order
        seen, now, later = set(), [], []
        for st, g in reports:
            (later if id(st) in seen else now).append((st, g))
            seen.add(id(st))
        groups: dict = {}
        for st, g in now:
            groups.setdefault((st.spec, g.device), []).append((st, g))
        for items in groups.values():
            g = torch.stack([g for _, g in items])
            observe_all([st for st, _ in items], g[:, 0], g[:, 1])
        reports = later


@torch.no_grad()
def observe_all(states: list[ScalingState], amax: torch.Tensor | None, bad_groups: torch.Tensor) -> None:
    """`ScalingState.observe` for distinct states of one Scaling at once: amax and bad_groups hold one value per
    state; amax matters for tensor granularity only."""
    s = states[0].spec
    if s.strategy == "delayed":
        record_all(states, amax)
        return
    if s.granularity == "tensor":
        scale, _ = scale_from_amax(amax, s, fallback=torch.stack([st.scale for st in states]))
        torch._foreach_copy_([st.scale for st in states], list(scale.unbind()))
        torch._foreach_copy_([st.amax_history[:1] for st in states], list(amax.reshape(-1, 1).unbind()))
    torch._foreach_add_([st.updates for st in states], 1)
    torch._foreach_add_([st.skipped for st in states], list(bad_groups.to(torch.int64).unbind()))


@torch.no_grad()
def record_all(states: list[ScalingState], amax: torch.Tensor) -> None:
    """Delayed scaling for distinct states of one Scaling at once (amax: one per state): push each amax into its
    window (a bad one is counted and recorded as 0, which no reduction picks), and every `interval` updates
    recompute the scale from the window."""
    s = states[0].spec
    bad = ~torch.isfinite(amax) | (amax <= 0)
    history = torch.stack([st.amax_history for st in states])
    history = torch.cat([torch.where(bad, torch.zeros_like(amax), amax)[:, None], history[:, :-1]], dim=1)
    updates = torch.stack([st.updates for st in states]) + 1
    # The history starts as zeros and amaxes are >= 0, so the max over the whole buffer is the max over what was
    # recorded: no host sync to slice it.
    reduced = history.amax(dim=1) if s.algo == "max" else history[:, 0]
    old = torch.stack([st.scale for st in states])
    new, _ = scale_from_amax(reduced, s, fallback=old)
    due = ((updates % s.interval) == 0) | (updates == 1)  # the first update always sets a scale
    torch._foreach_copy_([st.amax_history for st in states], list(history.unbind()))
    torch._foreach_copy_([st.updates for st in states], list(updates.unbind()))
    torch._foreach_copy_([st.scale for st in states], list(torch.where(due, new, old).unbind()))
    torch._foreach_add_([st.skipped for st in states], list(bad.to(torch.int64).unbind()))
