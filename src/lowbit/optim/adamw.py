"""AdamW with per-state storage precision (FP8-LM's precision decoupling).

Each parameter group carries a StatePrecision: what the weights, a master copy, the gradients and the two
moments are stored in. The update itself is fp32 math: decode the states, step, encode them again with fresh
per-tensor power-of-two scales, in MS-AMP's two stages as two passes over memory (the new states' amaxes, then
the states computed again and written with the scales those give). Groups that are all fp32 run torch's fused
AdamW kernel.

Gradients stored below the weights' precision (FP8, or bf16 for fp32 weights) are taken from autograd by a
post-accumulate hook: the wgrad GEMM's output (which every GEMM writes in high precision) waits in a run of up to
CHUNK gradients of one kind and shape, which one call (`_accumulate_all`, compiled on GPU) quantizes into the
stores and frees; what is left waiting is stored when the backward pass ends. So in eager mode fewer than CHUNK
high-precision gradients per run (a run per weight shape) live at a time beyond the layer's own; a compiled
backward hands a whole region's over together. Micro-batches accumulate by rescaling: the stored gradient is
decoded, the new one added in fp32, and the sum re-encoded with the scale of its own amax (one rounding per
micro-batch, never an overflow). Clearing a store costs nothing (its first add resets scale and flag), and
clipping rescales every scale at once.

On a GPU the update, the gradient stores and the stored norms are compiled for static shapes, each in two graphs
where it has both: one of reductions (the amaxes, split across the GPU), one of elementwise writes. Traced with
dynamic shapes, or with an amax and the writes it scales in one graph, inductor made kernels that one block of
threads ran over a whole tensor: fp8lm-o2's update took 10 s at `7b`.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import weakref

import torch
from torch.distributed.tensor import DTensor

from lowbit.backward_end import at_backward_end
from lowbit.errors import LowbitError
from lowbit.optim import update_kernel
from lowbit.optim.graphs import Graphed, key_of
from lowbit.optim.precision import KINDS, StatePrecision, decode, encode, pow2_scale, stochastic_round, store
from lowbit.optim.scaled_weight import ScaledFP16Weight
from lowbit.optim.state_bounds import bound_scales, exact_states, merged, scaled_states, stored_amaxes

_STATES = ("exp_avg", "exp_avg_sq", "master")
CHUNK = 8  # tensors per compiled call (update, gradient store): few calls, yet graphs that compile in seconds
SPAN = 1 << 16  # elements per slice of the eager CPU update: its fp32 temporaries stay in cache
CPU_COMPILE = 1 << 18  # on a CPU, the update of tensors this large is compiled (see LowbitAdamW._compiles)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter or gradient (a DTensor); any other tensor itself. States live
    beside the shard, so the update is plain tensor math on this rank's part."""
    return t.to_local() if isinstance(t, DTensor) else t


def _sum(g, data, scale, kind: str, filled: bool):
    """The gradient to store: `g`, plus the stored one if `filled` (in fp32)."""
    return g.float() + decode(data, kind, scale) if filled else g


def _accumulate(g, data, scale, nonfinite, kind: str, filled: bool, amax=None) -> None:
    """Quantize `g` into a store's data, scale and nonfinite flag (in place), adding the stored gradient first if
    `filled`; an empty store starts from scale 1 and a clear flag. `amax`: the sum's, if the caller has it."""
    g = _sum(g, data, scale, kind, filled)
    amax = g.abs().amax().float() if amax is None else amax
    bad = ~torch.isfinite(amax)  # an FP8 cast would saturate an Inf into a finite value
    if filled:
        nonfinite.bitwise_or_(bad)
    else:
        nonfinite.copy_(bad)
        scale.fill_(1.0)  # a skipped step's clipping may have left a NaN scale
    encode(g, kind, scale, out=data, amax=amax)


def _accumulate_all(gs, datas, scales, nonfinites, kind: str, filled: bool) -> None:
    """`_accumulate` for several stores of one kind (eager)."""
    for g, data, scale, nonfinite in zip(gs, datas, scales, nonfinites):
        _accumulate(g, data, scale, nonfinite, kind, filled)


def _sum_amaxes(gs, datas, scales, kind: str, filled: bool) -> list:
    """Pass one of storing a run: the sums' amaxes, a compiled graph of reductions only (see _write_all)."""
    return [_sum(g, d, s, kind, filled).abs().amax().float() for g, d, s in zip(gs, datas, scales)]


def _store_sums(gs, datas, scales, nonfinites, kind: str, filled: bool, amaxes) -> None:
    """Pass two: the sums again, quantized with the scales of their amaxes (elementwise only)."""
    for g, data, scale, nonfinite, amax in zip(gs, datas, scales, nonfinites, amaxes):
        _accumulate(g, data, scale, nonfinite, kind, filled, amax)


def _accumulate_compiled(amaxes_fn, store_fn):
    """`_accumulate_all` as the two compiled passes."""
    def accumulate(gs, datas, scales, nonfinites, kind, filled):
        store_fn(gs, datas, scales, nonfinites, kind, filled, amaxes_fn(gs, datas, scales, kind, filled))
    return accumulate


class GradStore:
    """A gradient kept in low precision between backward and the optimizer step. `fn_all`: `_accumulate_all`,
    compiled or not, for gradients that the hook queued (see `_take_grad`) and for add() (a DTensor gradient
    always takes the eager one)."""

    def __init__(self, p: torch.Tensor, kind: str, fn_all=_accumulate_all):
        self.kind = kind
        self.data = torch.zeros(p.shape, dtype=KINDS[kind][0], device=p.device)
        self.scale = torch.ones((), device=p.device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=p.device)
        self.filled = False
        self._fn_all = fn_all
        self._waiting = None  # the key of the run in _WAITING that holds a gradient for this store

    def add(self, g: torch.Tensor) -> None:
        fn = _accumulate_all if isinstance(g, DTensor) else self._fn_all
        fn([g], [self.data], [self.scale], [self.nonfinite], self.kind, self.filled)
        self.filled = True

    def value(self) -> torch.Tensor:
        return decode(self.data, self.kind, self.scale)

    def clear(self) -> None:
        self.filled = False  # the next add resets scale and flag (inside its graph: no launches here)
        if self._waiting is not None:  # left by a backward that raised: cleared with the rest
            run = _WAITING[self._waiting]
            run[:] = [(s, g) for s, g in run if s is not self]
            if not run:
                del _WAITING[self._waiting]
            self._waiting = None


# Gradients that arrived in this backward and wait to be stored, in runs of stores alike (kind, filled, device,
# compiled function, shape): a run is stored by one call when it reaches CHUNK, the rest when the backward ends.
# One compiled call per gradient cost about 0.7 ms of host time each on the H200's host (fp8lm-o1 at `1b`: 110 ms more
# GPU idle than fp8lm); CHUNK at a time, fewer than CHUNK high-precision gradients per run wait beyond their
# layer's. A backward that raises leaves its run waiting: the store's clear() drops it, step() stores it.
_WAITING: dict[tuple, list[tuple[GradStore, torch.Tensor]]] = {}


def _take_grad(p: torch.Tensor) -> None:
    owner = p._lowbit_grad_owner() if p._lowbit_grad_owner is not None else None
    if owner is None or p.grad is None:
        return
    store, g = owner._grads[p], p.grad
    p.grad = None
    if isinstance(g, DTensor):
        store.add(g)
        return
    if store._waiting is not None:  # a second gradient before the first was stored (a reentrant checkpoint that
        _store_run(_WAITING.pop(store._waiting))  # uses the parameter inside and out; a backward that raised)
    key = (store._fn_all, store.kind, store.filled, g.device, tuple(g.shape))  # one shape: static graphs
    run = _WAITING.setdefault(key, [])
    run.append((store, g))
    store._waiting = key
    if len(run) == CHUNK:
        _store_run(_WAITING.pop(key))
    at_backward_end(_store_waiting)


def _store_run(run: list[tuple[GradStore, torch.Tensor]]) -> None:
    first = run[0][0]
    first._fn_all([g for _, g in run], [s.data for s, _ in run], [s.scale for s, _ in run],
                  [s.nonfinite for s, _ in run], first.kind, first.filled)
    for s, _ in run:
        s.filled, s._waiting = True, None


def _store_waiting() -> None:
    runs = list(_WAITING.values())
    _WAITING.clear()
    for run in runs:
        _store_run(run)


def _bias(step, beta1: float, beta2: float) -> torch.Tensor:
    """AdamW's bias corrections for the step after `step`: [1 - beta1^t, sqrt(1 - beta2^t)]."""
    t = step + 1
    return torch.stack([1 - beta1 ** t, torch.sqrt(1 - beta2 ** t)])


def _fresh(p, g, g_scale, g_kind, m, m_scale, v, v_scale, master, master_scale, step, wd, bias, lr, beta1, beta2,
           eps, kinds, weights: bool = True):
    """The updated moments (and weights, if `weights`) in fp32, from stored states: AdamW's math, elementwise, so
    any slice of the tensors gives that slice of the result. `step`, `lr`: 0-dim tensors (no recompiles). `bias`:
    _bias(step) if the caller has it (a CPU's: inductor's C++ kernels computed its powers once per vector, a third
    of the update's time), else None."""
    k_m, k_v, k_master = kinds[:3]
    g = decode(g, g_kind, g_scale)
    bc1, bc2 = _bias(step, beta1, beta2) if bias is None else bias
    m32 = decode(m, k_m, m_scale).lerp(g, 1 - beta1)  # out of place: an fp32 state decodes to itself
    v32 = (decode(v, k_v, v_scale) * beta2).addcmul_(g, g, value=1 - beta2)
    if not weights:
        return m32, v32, None
    w = decode(master, k_master, master_scale) if k_master != "none" else p.float()
    w = w * (1 - lr * wd)
    denom = (v32.sqrt() / bc2).add_(eps)
    return m32, v32, w - (lr / bc1) * m32 / denom


def _pieces(tensors, span: int | None) -> list:
    """The tensors whole (span None, or one that is not contiguous), or in slices of `span` elements."""
    n = max(t.numel() for t in tensors)
    if span is None or span >= n or not all(t.is_contiguous() for t in tensors):
        return [tensors]
    flat = [t.view(-1) if t.dim() else t for t in tensors]  # a 0-dim `master` is a placeholder
    return [[t[i:i + span] if t.dim() else t for t in flat] for i in range(0, n, span)]


def _amaxes(item: tuple, lr, beta1, beta2, eps, kinds, span=None, keep: bool = False):
    """Pass one of the update (MS-AMP's first stage): the amax of the new value of each state whose scale comes
    from it (exact_states), nothing written. Returns (amaxes or None, pass one's values when `keep` and the tensor
    was one piece)."""
    p, g, g_scale, g_kind, m, m_scale, v, v_scale, master, master_scale, step, wd, bias, _ = item
    scaled = exact_states(kinds, m_scale, v_scale, master_scale)
    if not scaled:
        return None, None
    pieces = _pieces((p, g, m, v, master), span)
    keep = keep and len(pieces) == 1
    amax = kept = None
    for pp, gg, mm, vv, ww in pieces:
        out = _fresh(pp, gg, g_scale, g_kind, mm, m_scale, vv, v_scale, ww, master_scale, step, wd, bias, lr, beta1,
                     beta2, eps, kinds, weights=keep or scaled[-1][0] == "w")
        now = torch.stack([dict(zip("mvw", out))[n].abs().amax() for n, _, _ in scaled])
        amax = now if amax is None else torch.maximum(amax, now)
        kept = out if keep else None
    return amax, kept


def _new_scales(item: tuple, kinds, amax):
    """The scales the new amaxes give the states that take theirs from one (in exact_states' order), or None."""
    scaled = exact_states(kinds, item[5], item[7], item[9])
    return torch.stack([pow2_scale(amax[i], KINDS[k][2], s) for i, (_, k, s) in enumerate(scaled)]) \
        if scaled else None


def _put(x, kind: str, scale, out, rounding: str, record: bool):
    """store() into `out`; with `record`, the amax of what was stored. Rounding to nearest is monotonic in the
    magnitude, so that is the stored form of x's amax: a reduction of x, which fuses into the loop that writes
    (reading `out` back did not, compiled on a CPU); stochastic rounding is not, and reads the data it stored."""
    if not record:
        store(x, kind, scale, out=out, rounding=rounding)
        return None
    if rounding == "nearest":
        store(x, kind, scale, out=out)
        return decode(store(x.abs().amax(), kind, scale), kind, scale)
    data = store(x, kind, scale, rounding=rounding)
    out.copy_(data)
    return decode(data, kind, scale).abs().amax()


def _write(item: tuple, lr, beta1, beta2, eps, kinds, scales, span=None, kept=None, record: bool = False) -> None:
    """Pass two (the second stage): the new states computed again (or `kept` from pass one) and written with
    `scales` (each scaled state's, in scaled_states' order: `merged`); the step counted. `record`: the amaxes of
    the scaled states written, into item[13] (bounded and mixed scales: what the next step's bounds start from)."""
    p, g, g_scale, g_kind, m, m_scale, v, v_scale, master, master_scale, step, wd, bias, _ = item
    k_m, k_v, k_master, rounding, own, _ = kinds
    scaled = scaled_states(kinds, m_scale, v_scale, master_scale)
    new = {n: scales[i] for i, (n, _, _) in enumerate(scaled)}
    seen = {}
    for pp, gg, mm, vv, ww in _pieces((p, g, m, v, master), span):
        m32, v32, w = kept if kept is not None else _fresh(pp, gg, g_scale, g_kind, mm, m_scale, vv, v_scale, ww,
                                                            master_scale, step, wd, bias, lr, beta1, beta2, eps, kinds)
        now = {"m": _put(m32, k_m, new.get("m", m_scale), mm, rounding, record and "m" in new),
               "v": _put(v32, k_v, new.get("v", v_scale), vv, rounding, record and "v" in new)}
        if k_master != "none":  # a low-precision master loses updates under half its ulp unless rounded stochastically
            now["w"] = _put(w, k_master, new.get("w", master_scale), ww, rounding, record and "w" in new)
        elif rounding == "stochastic" and p.dtype == torch.bfloat16:  # bf16 weights are their own master: the same
            w = stochastic_round(w, "bf16")
        if not own:  # `own`: the master is the weights' own storage (a ScaledFP16Weight), just written
            pp.copy_(w)
        seen = {n: a if n not in seen else torch.maximum(seen[n], a) for n, a in now.items() if a is not None}
    if record:
        for n, a in seen.items():
            item[13]["mvw".index(n)] = a
    for n, _, s in scaled:
        s.copy_(new[n])
    step += 1


def _record_all(items: list[tuple], kinds) -> None:
    """The written states' amaxes into each item's record (item[13]), for the next step's bounds."""
    for item in items:
        item[13].copy_(stored_amaxes(kinds, *item[4:10]))


def _update_all(items: list[tuple], lr, beta1, beta2, eps, kinds, span=None) -> None:
    """One AdamW step in fp32 on stored states (in place) for every tensor of a chunk, eagerly: two passes over
    memory (amaxes, then the writes; bounded scales the writes alone, mixed ones pass one for the FP8 states
    only), so no fp32 copy of a state is kept; a CPU walks each tensor in slices of
    `span` elements (its temporaries stay in cache). A tensor in one piece keeps pass one's values for pass two.
    A CPU compiles it as one graph for large tensors (see LowbitAdamW._compiles)."""
    keep = not torch.compiler.is_compiling()  # compiled (a CPU's one graph), recomputing costs less than storing
    bounded = kinds[5] != "amax"  # bound or mixed: scales from bounds, the written states' amaxes recorded
    for item, b in zip(items, bound_scales(items, lr, beta1, beta2, kinds) if bounded else [None] * len(items)):
        amax, kept = _amaxes(item, lr, beta1, beta2, eps, kinds, span, keep=keep) if kinds[5] != "bound" \
            else (None, None)  # bound: no pass before the writes
        new = merged(item, kinds, _new_scales(item, kinds, amax), b)
        _write(item, lr, beta1, beta2, eps, kinds, new, span, kept, record=bounded)
        if not bounded and item[13].dim():  # a GPU's record for the Triton update (see _items): unknown now
            item[13].zero_()


def _amaxes_all(items: list[tuple], lr, beta1, beta2, eps, kinds) -> list:
    """Pass one for a chunk: one compiled graph of reductions only (split across the GPU), returning the new
    scales of the states scaled from an amax (exact_states), which pass two loads."""
    return [_new_scales(item, kinds, _amaxes(item, lr, beta1, beta2, eps, kinds)[0]) for item in items]


def _write_all(items: list[tuple], lr, beta1, beta2, eps, kinds, scales) -> None:
    """Pass two for a chunk: one compiled graph of elementwise kernels, the new scales its inputs. Compiled apart
    from pass one: in one graph, inductor fused each tensor's reduction and writes into a kernel that one block of
    threads ran over the whole tensor (fp8lm-o2's update took 10 s at `7b`)."""
    for item, new in zip(items, scales):
        _write(item, lr, beta1, beta2, eps, kinds, new)


def _update_compiled(amaxes_fn, write_fn, record_fn):
    """The update as the two compiled passes (mixed scales: pass one for the FP8 states only); with bounded or
    mixed scales, then the reductions that record the written states' amaxes (in one graph with the writes,
    inductor ran each tensor's on one block of threads)."""
    def update(items, lr, beta1, beta2, eps, kinds, span=None):
        exact = amaxes_fn(items, lr, beta1, beta2, eps, kinds) if kinds[5] != "bound" else [None] * len(items)
        if kinds[5] == "amax":
            write_fn(items, lr, beta1, beta2, eps, kinds, exact)
            return
        bounded = bound_scales(items, lr, beta1, beta2, kinds)
        write_fn(items, lr, beta1, beta2, eps, kinds, [merged(it, kinds, e, b) for it, e, b in
                                                        zip(items, exact, bounded)])
        record_fn(items, kinds)
    return update


def _chunks(items: list[tuple]) -> list[list[tuple]]:
    """Runs of CHUNK items of one shape and weight decay. The update is compiled for static shapes (traced with
    dynamic ones, its amax reductions ran on a handful of the GPU's cores: fp8lm-o2's update took 10 s at `7b`),
    so a chunk holds tensors of one shape, and a model's few weight shapes give a few graphs."""
    runs: dict[tuple, list[tuple]] = {}
    for item in items:
        runs.setdefault((item[11], tuple(item[1].shape)), []).append(item)  # the gradient's: p may be a placeholder
    return [run[i:i + CHUNK] for run in runs.values() for i in range(0, len(run), CHUNK)]


@functools.cache
def _have_cxx() -> bool:
    """Whether inductor's C++ backend finds a compiler (looked up once: the update asks every step)."""
    return shutil.which(os.environ.get("CXX", "g++")) is not None


def _passes_apart(device: torch.device) -> bool:
    """Whether a compiled update or gradient store runs its reductions and its writes as two graphs: on a GPU (see
    _write_all); a CPU's C++ kernels have no single-block fusion to avoid, and one graph is faster there."""
    return device.type != "cpu"


def _with_recompile_limit(compiled, limit: int = 64):
    """`compiled` allowed `limit` graphs (dynamo's default, 8, would send a model's ninth chunk shape to eager)."""
    @functools.wraps(compiled)
    def call(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=limit):
            return compiled(*args, **kwargs)
    return call


def _stored_norms(datas: list[torch.Tensor], scales: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([d.float().norm() / s for d, s in zip(datas, scales)])


class LowbitAdamW(torch.optim.Optimizer):
    """AdamW whose storage is set per group: `precision` (a StatePrecision) in a group or the defaults.

    As MS-AMP's initialize does, the constructor converts each parameter to its `weights` storage (a master copy
    is taken from the parameter first). Weight decay applies to tensors of 2+ dims only unless a group sets
    `decay_1d`. States are allocated at construction, so memory can be measured before the first step."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 precision: StatePrecision = StatePrecision(), decay_1d: bool = False, compile: bool | None = None,
                 cuda_graphs: bool = True):
        if not 0.0 <= lr or not 0.0 <= eps or not 0.0 <= weight_decay:
            raise LowbitError(f"optimizer: lr, eps and weight_decay must be >= 0 (got {lr}, {eps}, {weight_decay})")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, decay_1d=decay_1d,
                        precision=precision, covered=False)
        self._grads: dict[torch.Tensor, GradStore] = {}
        self.shard_group = None  # tensor parallelism: the group over which split parameters' norms add up
        self.stage_group = None  # pipeline parallelism: the stages, whose (disjoint) parameters' norms add up
        self.fsdp_group = None  # FSDP2: every parameter is split over it, so the squared norms add up over it
        self.owned: set | None = None  # ZeRO-1: the parameters whose states this process keeps (None: all)
        self._compile = compile
        self._compiled: dict[str, object] = {}
        self._placeholder: dict[torch.device, torch.Tensor] = {}
        self._amax: dict[torch.Tensor, torch.Tensor] = {}  # each parameter's states' last amaxes (see _items)
        self._versions: dict[torch.Tensor, int] = {}  # amax scales: its master's version when last seen
        self.cuda_graphs = cuda_graphs  # on a GPU: the update and the stored norms replayed (lowbit.optim.graphs)
        self._graphed: dict[tuple, Graphed] = {}  # (what, device) -> its graph
        self._lr: dict[tuple[int, torch.device], torch.Tensor] = {}
        super().__init__(params, defaults)  # calls add_param_group for each group

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        prec = group["precision"]
        prec = StatePrecision(**prec) if isinstance(prec, dict) else prec
        group["precision"] = dict(prec.__dict__)  # plain strings: state_dict stays loadable anywhere
        for p in group["params"]:
            self._init_param(p, prec)

    def shard(self, owned: set) -> None:
        """ZeRO-1: keep states (and update weights) only for `owned`; the owners broadcast the others' weights."""
        self.owned = owned
        for p in [p for g in self.param_groups for p in g["params"] if p not in owned]:
            self.state.pop(p, None)

    @staticmethod
    def precision_of(group) -> StatePrecision:
        return StatePrecision(**group["precision"])

    def _init_param(self, p: torch.Tensor, prec: StatePrecision) -> None:
        st = self.state[p]
        st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for name in _STATES:
            kind = getattr(prec, name)
            if kind == "none":
                continue
            init = local(p.detach()).float() if name == "master" else torch.zeros(local(p).shape, device=p.device)
            st[f"{name}_scale"] = torch.ones((), device=p.device)
            st[name] = encode(init, kind, st[f"{name}_scale"])
        if prec.weights == "fp16":
            if not isinstance(p, ScaledFP16Weight):  # the same Parameter object, now stored scaled
                torch.utils.swap_tensors(p, torch.nn.Parameter(ScaledFP16Weight.of(p), p.requires_grad))
            st["weights_scale"] = p._scale  # the scale itself, so that a checkpoint saves and loads it in place
        elif p.dtype != KINDS[prec.weights][0]:
            p.data = p.data.to(KINDS[prec.weights][0])
        # One hook per parameter, taking gradients for whichever optimizer holds it last (none: left alone).
        p._lowbit_grad_owner = None
        if prec.grads != prec.weights:
            self._grads[p] = GradStore(p, prec.grads, self._fn(_accumulate_all, p.device))
            p._lowbit_grad_owner = weakref.ref(self)
            if not getattr(p, "_lowbit_grad_hooked", False):
                p.register_post_accumulate_grad_hook(_take_grad)
                p._lowbit_grad_hooked = True

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The current gradient of `p` in fp32 (None if it has none)."""
        store = self._grads.get(p)
        if store is not None:
            return store.value() if store.filled else None
        return None if p.grad is None else p.grad.float()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for store in self._grads.values():
            store.clear()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Global L2 norm of all gradients (NaN if any is non-finite); scales them to `max_norm` if above it
        (0 or inf: only measure). A scaled stored gradient is clipped exactly, by changing its scale."""
        _store_waiting()  # as in step
        plain_params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        plain = [local(p.grad) for p in plain_params]
        stored_items = [(p, s) for p, s in self._grads.items() if s.filled]
        stored = [s for _, s in stored_items]
        norms = [n.float() for n in torch._foreach_norm(plain)] if plain else []
        if stored:
            norms += list(self._stored_norms(stored))
        if not norms:
            return torch.zeros(())
        if self.shard_group is None:
            total = torch.linalg.vector_norm(torch.stack(norms))
        else:  # tensor-parallel shards: their squares summed over the group, replicated tensors counted once
            split = torch.tensor([hasattr(p, "_lowbit_tp_dim") for p in plain_params + [p for p, _ in stored_items]],
                                 device=norms[0].device)
            squares = torch.stack(norms).pow(2)
            part = torch.where(split, squares, torch.zeros_like(squares)).sum()
            torch.distributed.all_reduce(part, group=self.shard_group)
            total = (torch.where(split, torch.zeros_like(squares), squares).sum() + part).sqrt()
        for group in (self.stage_group, self.fsdp_group):  # disjoint parameters, or disjoint parts of them
            if group is not None:
                squared = total.pow(2)
                torch.distributed.all_reduce(squared, group=group)
                total = squared.sqrt()
        if stored:
            bad = torch.stack([s.nonfinite for s in stored]).any()
            total = torch.where(bad, torch.full_like(total, float("nan")), total)
        if max_norm and math.isfinite(max_norm):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))  # a bad step is skipped, not scaled
            if plain:
                torch._foreach_mul_(plain, coef.to(plain[0].device))
            scales = [s.scale for s in stored if KINDS[s.kind][1]]
            if scales:  # one launch, not one per parameter
                torch._foreach_div_(scales, coef)
            for s in stored:
                if not KINDS[s.kind][1]:
                    s.data.mul_(coef.to(s.data.dtype))
        return total

    def _stored_norms(self, stored: list[GradStore]) -> torch.Tensor:
        """The stored gradients' norms (in the order of `stored`), CHUNK of one shape per compiled call (static
        shapes, as the update), one CUDA graph on a GPU."""
        device = stored[0].data.device
        by_shape: dict[tuple, list[int]] = {}
        for i, s in enumerate(stored):
            by_shape.setdefault(tuple(s.data.shape), []).append(i)
        runs = [idx[j:j + CHUNK] for idx in by_shape.values() for j in range(0, len(idx), CHUNK)]
        at = {i: k for k, i in enumerate(i for r in runs for i in r)}  # where stored[i]'s norm lands

        def run():  # every tensor it uses made inside it: a CUDA graph replays their addresses
            fn = self._fn(_stored_norms, device)
            norms = torch.cat([fn([stored[i].data for i in r], [stored[i].scale for i in r]) for r in runs])
            return torch.stack([norms[at[i]] for i in range(len(stored))])

        return self._replayed("norms", device, lambda: [(s.data, s.scale) for s in stored], run)

    def _replayed(self, what: str, device: torch.device, touched, run):
        """run(); on a GPU replayed as a CUDA graph (lowbit.optim.graphs) keyed by touched(): the tensors and
        values it reads or writes."""
        if not (self.cuda_graphs and device.type == "cuda"):
            return run()
        return self._graphed.setdefault((what, device), Graphed(device))(key_of(touched()), run)

    def _compiles(self, fn, device: torch.device, numel: int = 0) -> bool:
        """Whether `fn` runs compiled: on a GPU, and on a CPU the update of tensors of CPU_COMPILE elements or more
        (inductor's C++ kernels fuse it: 4-7x faster than eager slices, for 5-10 s of compiling per weight shape on
        two cores) where a C++ compiler is found; the constructor's `compile` decides if given."""
        if self._compile is not None:
            return self._compile
        if device.type == "cuda":
            return True
        return fn is _update_all and numel >= CPU_COMPILE and _have_cxx()

    def _fn(self, fn, device: torch.device, numel: int = 0):
        """`fn`, compiled where it pays (see _compiles)."""
        if not self._compiles(fn, device, numel):
            return fn
        key = (fn.__name__, device.type)
        if key not in self._compiled:
            static = lambda f: _with_recompile_limit(torch.compile(f, dynamic=False))  # noqa: E731
            if fn is _update_all and _passes_apart(device):  # static shapes (see _chunks), the passes in two graphs
                compiled = _update_compiled(static(_amaxes_all), static(_write_all), static(_record_all))
                self._compiled[key] = update_kernel.with_fallback(compiled)  # Triton's passes where they apply
            elif fn is _accumulate_all and _passes_apart(device):  # likewise, runs of one shape (see _take_grad)
                self._compiled[key] = _accumulate_compiled(static(_sum_amaxes), static(_store_sums))
            else:  # the stored norms (reductions alone, in chunks of one shape); on a CPU, whose C++ kernels have no
                self._compiled[key] = static(fn)  # such fusion to avoid, one graph (pass one's values kept)
        return self._compiled[key]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        _store_waiting()  # nothing waits after a backward that ended; after one that raised, what it left
        updates: dict[torch.device, list[tuple]] = {}  # device -> the compiled update calls of its chunks
        for gi, group in enumerate(self.param_groups):
            prec = self.precision_of(group)
            beta1, beta2 = group["betas"]
            pairs = [(p, g) for p in group["params"] if (self.owned is None or p in self.owned)
                     and (g := self._grad_for_step(p)) is not None]
            if not pairs:
                continue
            wd_of = [group["weight_decay"] if (p.dim() >= 2 or group["decay_1d"]) else 0.0 for p, _ in pairs]
            if prec.all_fp32:
                for wd in set(wd_of):
                    sub = [pg for pg, w in zip(pairs, wd_of) if w == wd]
                    ps = [p for p, _ in sub]
                    st = [self.state[p] for p in ps]
                    ps = [local(p) for p in ps]
                    torch._foreach_add_([s["step"] for s in st], 1)  # the fused kernel reads, not counts, steps
                    torch._fused_adamw_(ps, [local(g) for _, g in sub], [s["exp_avg"] for s in st],
                                        [s["exp_avg_sq"] for s in st], [], [s["step"] for s in st], lr=group["lr"],
                                        beta1=beta1, beta2=beta2, weight_decay=wd, eps=group["eps"], amsgrad=False,
                                        maximize=False)
                continue
            device = pairs[0][0].device
            updates.setdefault(device, [])
            own = prec.weights == "fp16"  # ScaledFP16Weights: their data and scale are the master, updated in place
            kinds = (prec.exp_avg, prec.exp_avg_sq, "fp16" if own else prec.master, prec.rounding, own, prec.scales)
            items = self._items(pairs, wd_of, device, beta1, beta2, kinds)
            lr = self._lr.get((gi, device))  # a tensor: no recompiles as lr changes, and a graph reads it
            if lr is None:
                lr = self._lr[(gi, device)] = torch.zeros((), device=device)
            lr.fill_(group["lr"])
            for chunk in _chunks(items):  # eager on a CPU: in slices; compiled: whole tensors, fused
                numel = chunk[0][1].numel()
                span = None if self._compiles(_update_all, device, numel) else SPAN
                updates[device].append((self._fn(_update_all, device, numel),
                                        (chunk, lr, beta1, beta2, group["eps"], kinds, span)))
        for device, calls in updates.items():
            def run(device=device, calls=calls):
                for fn, args in calls:
                    fn(*args)

            self._replayed("update", device, lambda calls=calls: calls, run)
        return loss

    def _items(self, pairs, wd_of, device, beta1: float, beta2: float, kinds) -> list[tuple]:
        """The update's view of each (parameter, gradient): its stored gradient, moments and master (with their
        scales), step, weight decay, a CPU's bias corrections and, with bounded or mixed scales, the record of its
        states' last amaxes (measured from the states when there is none: a first step, a load)."""
        none = self._placeholder.setdefault(device, torch.ones((), device=device))  # for absent states
        own = kinds[4]
        items = []
        for (p, g), wd in zip(pairs, wd_of):
            st = self.state[p]
            store = self._grads.get(p)
            grad = (store.data, store.scale, store.kind) if store is not None else (local(g), none, "fp32")
            # detached: a Parameter's shape is static to dynamo (a graph per weight shape), a tensor's is not
            w, master = (none, (p._data, p._scale)) if own else \
                (local(p).detach(), (st.get("master", none), st.get("master_scale", none)))
            # a CPU's bias corrections computed here, once (see _fresh); a GPU's in its graphs, which replay
            bias = _bias(st["step"], beta1, beta2) if device.type == "cpu" else None
            item = (w, *grad, st["exp_avg"], st["exp_avg_scale"], st["exp_avg_sq"], st["exp_avg_sq_scale"],
                    *master, st["step"], wd, bias)
            if p not in self._amax and kinds[5] != "amax":
                self._amax[p] = stored_amaxes(kinds, *item[4:10])
            elif p not in self._amax and device.type == "cuda":  # amax scales: the Triton update's (0: unknown)
                self._amax[p] = torch.zeros(3, device=device)
            if kinds[5] == "amax" and p in self._amax:
                self._unknown_if_written(p, item[8])
            items.append(item + (self._amax.get(p, none),))
        return items

    def _unknown_if_written(self, p, master: torch.Tensor) -> None:
        """Zero `p`'s amax record (unknown) where its master was written since the last step by anything but the
        Triton kernels, whose raw writes leave a tensor's version as it is: an in-place op on a ScaledFP16Weight,
        a model's load_state_dict (an update outside the kernels zeroes the record itself). A record of weights
        since scaled up would certify a scale they overflow."""
        version = master._version
        if self._versions.get(p) != version:
            self._amax[p].zero_()
            self._versions[p] = version

    def _grad_for_step(self, p):
        """What marks `p` as having a gradient this step (the data itself is read in the update)."""
        store = self._grads.get(p)
        if store is not None:
            return store.data if store.filled else None
        return p.grad

    @torch.no_grad()
    def state_telemetry(self, names: dict) -> dict:
        """Health of the moments stored in scaled kinds, {moment: {...}} over every parameter this process keeps
        states of (under ZeRO its own share; pipeline stages, their own parameters). `names`: parameter -> name.

        zero_pct: stored entries that are exactly 0. stuck_pct: of the non-zero ones, those a decay by the
        moment's beta alone leaves unchanged (same scale), i.e. that cannot shrink: under round-to-nearest those
        whose decayed value rounds back to them (every E5M2 entry at beta 0.95); under stochastic rounding only
        those whose fp32 decay is no change, since any other rounds down with a positive probability.
        worst / worst_stuck_pct: the tensor with the highest stuck_pct. subnormal_pct: of the non-zero ones, those
        stored as subnormals of their format (fewer significant bits than the rest; a scale below the amax's puts
        more there). exp_avg_sq adds m_nonzero_v_zero_pct: entries with a non-zero first moment over a zero second
        moment, whose update is m / eps."""
        rows: dict[str, list] = {}  # moment -> (kind, name, numel, counts: zero, non-zero, stuck, m!=0 & v==0,
        # subnormal)
        for group in self.param_groups:
            prec = self.precision_of(group)
            for moment, beta in zip(("exp_avg", "exp_avg_sq"), group["betas"]):
                kind = getattr(prec, moment)
                if not KINDS[kind][1]:
                    continue
                for p in group["params"]:
                    st = self.state.get(p)
                    if not st or moment not in st:  # ZeRO: another replica keeps it
                        continue
                    d = st[moment].float()  # data / scale with a power-of-two scale: the decay is exact on data
                    nonzero = d != 0
                    decayed = d * beta if prec.rounding == "stochastic" else (d * beta).to(KINDS[kind][0]).float()
                    stuck = nonzero & (decayed == d)
                    m_only = (st["exp_avg"].float() != 0) & ~nonzero if moment == "exp_avg_sq" \
                        else torch.zeros_like(stuck)
                    subnormal = nonzero & (d.abs() < torch.finfo(KINDS[kind][0]).tiny)
                    counts = [~nonzero, nonzero, stuck, m_only, subnormal]
                    rows.setdefault(moment, []).append(
                        (kind, names.get(p, f"param{len(rows.get(moment, ()))}"), d.numel(),
                         torch.stack([c.sum() for c in counts])))
        if not rows:
            return {}
        flat = torch.stack([r[3] for rs in rows.values() for r in rs]).tolist()  # one host sync
        out = {}
        for moment, rs in rows.items():
            counts, flat = flat[:len(rs)], flat[len(rs):]
            pct = [100 * c[2] / c[1] if c[1] else 0.0 for c in counts]
            worst = max(range(len(rs)), key=pct.__getitem__)
            total = [sum(col) for col in zip(*counts)]
            n = sum(r[2] for r in rs)
            out[moment] = {"kind": "/".join(sorted({r[0] for r in rs})), "zero_pct": 100 * total[0] / max(n, 1),
                           "stuck_pct": 100 * total[2] / total[1] if total[1] else 0.0, "worst": rs[worst][1],
                           "worst_stuck_pct": pct[worst],
                           "subnormal_pct": 100 * total[4] / total[1] if total[1] else 0.0}
            if moment == "exp_avg_sq":
                out[moment]["m_nonzero_v_zero_pct"] = 100 * total[3] / max(n, 1)
        return out

    def hyper(self) -> list[dict]:
        """The groups' settings (learning rate, betas, storage precision...) without their parameters."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    def load_hyper(self, saved, check_sizes: bool = False) -> None:
        """Take saved group settings, after checking they describe the same groups stored the same way."""
        groups = self.param_groups
        if not isinstance(saved, list) or len(saved) != len(groups):
            raise LowbitError(f"optimizer state: {len(saved) if isinstance(saved, list) else 'no'} parameter groups "
                              f"saved, this model has {len(groups)} (another model or recipe)")
        def storage(prec):  # rounding and scales are how states are written, not what: they may change on resume
            return {k: v for k, v in (prec or {}).items() if k not in ("rounding", "scales")}

        for i, (g, s) in enumerate(zip(groups, saved)):
            if check_sizes and len(g["params"]) != len(s.get("params", ())):
                raise LowbitError(f"optimizer state: group {i} holds {len(s.get('params', ()))} tensors, this model "
                                  f"has {len(g['params'])} (another model or recipe)")
            if storage(s.get("precision")) != storage(g["precision"]):
                raise LowbitError(f"optimizer state: group {i} was stored as {storage(s.get('precision'))}, this "
                                  f"run asks for {storage(g['precision'])} (another recipe or [optim] setting)")
        for g, s in zip(groups, saved):
            g.update({k: v for k, v in s.items() if k not in ("params", "precision")})
        self._amax.clear()  # the states are about to be replaced: their amaxes are measured again when needed

    # ---- checkpoints: states are restored exactly as stored (torch's default would cast them to the weights'
    # dtype, turning an FP8 moment into bf16) ----
    def load_state_dict(self, state_dict: dict) -> None:
        groups, saved = self.param_groups, state_dict.get("param_groups")
        if "state" not in state_dict:
            raise LowbitError("optimizer state: no per-parameter states saved")
        self.load_hyper(saved, check_sizes=True)
        params = [p for g in groups for p in g["params"]]
        ids = [i for s in saved for i in s["params"]]
        for i, p in zip(ids, params):
            st = state_dict["state"].get(i)
            if st is None:
                continue
            for name in _STATES:
                if name in st and tuple(st[name].shape) != tuple(p.shape):
                    raise LowbitError(f"optimizer state: a {name} of shape {tuple(st[name].shape)} for a parameter "
                                      f"of shape {tuple(p.shape)} (another model)")
        for i, p in zip(ids, params):
            if i in state_dict["state"] and (self.owned is None or p in self.owned):
                self.state[p] = {k: v.to(p.device) if isinstance(v, torch.Tensor) else v
                                 for k, v in state_dict["state"][i].items()}
                if isinstance(p, ScaledFP16Weight) and "weights_scale" in self.state[p]:  # the weight's own scale
                    p._scale.copy_(self.state[p]["weights_scale"])
                    self.state[p]["weights_scale"] = p._scale
