"""The training loop: build everything, check everything, then train, validate, checkpoint and report.

Nothing is written to the run directory until every input has been checked (config, data, tokenizer, resume
checkpoint), so a failed start leaves what is on disk as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch

from lowbit.data import Loader, TokenDataset, resolve_dataset, val_batches
from lowbit.distributed import context_parallel, tensor_parallel
from lowbit.distributed.fsdp_fp8 import precompute_amax
from lowbit.distributed.mesh import init_mesh, lead_first, local_device, mean_over
from lowbit.distributed.sharded_state import checkpoint_tensors
from lowbit.distributed.parallelize import parallelize, parallelize_optimizer, pipeline_schedules
from lowbit.distributed.tensor_parallel import sync_partial_grads
from lowbit.distributed import pipeline
from lowbit.errors import LowbitError
from lowbit.models.llama import Llama, ModelArgs, resolve_model_args
from lowbit.models.performer import redraw_features
from lowbit.numerics.linear import LowPrecisionLinear
from lowbit.optim import LowbitAdamW, StatePrecision, lr_lambda
from lowbit.optim.memory import format_report, memory_report
from lowbit.numerics.recipes import convert, covered_linears
from lowbit.numerics.scaling import reports_held
from lowbit.train import checkpoint as ckpt
from lowbit.models.init import materialize
from lowbit.train.compile import compile_model, eager
from lowbit.train.config import Config, resolve_recipe, to_dict, to_toml
from lowbit.train.metrics import (Metrics, check_tensorboard, gpu_peak_flops, plot_losses, progress_line,
                                  truncate_after, warn)

# Model args that may differ on resume: how the same function is computed, not which.
RESUMABLE_CHANGES = ("checkpointing", "init_std", "performer_chunk", "performer_redraw", "sdpa_backend")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise LowbitError(f"run.device: {name!r} is not a device (auto, cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise LowbitError(f"run.device: {name!r}: lowbit runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise LowbitError(f"run.device: {name!r} asked for, but CUDA is not available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise LowbitError(f"run.device: {name!r}, but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_optimizer(model: torch.nn.Module, recipe, precision: StatePrecision, cfg: Config) -> LowbitAdamW:
    """AdamW: the weights of the linears the recipe covers with its storage precision, everything else fp32;
    weight decay on 2+-dim tensors only."""
    covered = {id(model.get_submodule(name).weight) for name in covered_linears(model, recipe)}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) in covered], "precision": precision, "covered": True},
              {"params": [p for p in params if id(p) not in covered]}]
    t = cfg.train
    return LowbitAdamW([g for g in groups if g["params"]], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                       weight_decay=t.weight_decay, cuda_graphs=cfg.optim.cuda_graphs)


def _finite_or_none(v: float) -> float | None:
    """JSON has no NaN: a skipped step's loss or norm is written as null."""
    return v if math.isfinite(v) else None


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


def prepare_run_dir(run_dir: Path, resume: bool) -> None:
    """Refuse to start over an existing run (unless resuming) and fail early if the directory is not writable."""
    if not resume and ((run_dir / "metrics.jsonl").exists() or ckpt.list_checkpoints(run_dir)):
        raise LowbitError(f"run.dir: {run_dir} already holds a run; pass --run.resume to continue it or choose "
                          f"another --run.dir")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise LowbitError(f"run.dir: {run_dir} is not writable ({e.strerror or e})") from None


class _StopRequest:
    """SIGINT/SIGTERM end the run after the current step, with a checkpoint."""

    def __init__(self):
        self.requested = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, device) -> bool:
        """Whether any process was asked to stop (a MAX all-reduce over all of them)."""
        import torch.distributed as dist

        flag = torch.tensor([float(self.requested)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())  # not written back: a signal arriving meanwhile joins the next step's vote

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


class _Silent:
    """Metrics of a rank other than 0: rank 0 writes for everyone."""

    def log(self, record: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


@torch.no_grad()
def evaluate(model, batches, device, autocast, positions=None, group=None, pipe=None) -> float:
    """Mean validation loss; with context parallelism each rank scores its shard and the ranks average; with
    pipeline parallelism (`pipe`: schedule, stage module, micro-batches) the stages run it together."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for x, y in batches:
        b = x.shape[0]  # each sequence weighs the same, also in a smaller last batch
        count += b
        if positions is not None:
            x, y = x[:, positions.cpu()], y[:, positions.cpu()]
        with autocast():
            if pipe is not None:
                total += pipeline.run(pipe[0], pipe[1], x.to(device), y.to(device), train=False) / pipe[2] * b
            else:
                total += model(x.to(device), y.to(device), positions=positions).float() * b
    model.train(was_training)
    return mean_over(total, group).item() / max(1, count)


def train(cfg: Config) -> dict:
    """Train according to `cfg`; returns a summary (final step, losses, run dir)."""
    t = cfg.train
    run_dir = Path(cfg.run.dir)
    n = cfg.numerics
    recipe = resolve_recipe(cfg)
    precision = recipe.optim
    device = local_device(resolve_device(cfg.run.device))
    dtype = compute_dtype(t.dtype, device)
    if device.type != "cuda" and cfg.model.sdpa_backend in ("cudnn", "efficient"):
        raise LowbitError(f"model.sdpa_backend: {cfg.model.sdpa_backend} runs on CUDA only, not on {device}")
    mesh = init_mesh(cfg.parallel, device)
    lead = mesh.rank == 0
    say = print if lead else (lambda *a, **k: None)
    if recipe.linear is None and precision.weights != "fp32" and dtype == torch.float32:
        raise LowbitError(f"optim.weights: {precision.weights} weights in high-precision linears need autocast "
                          f"(train.dtype bf16)")

    # ---- check every input before writing anything ----
    data_path = lead_first(mesh, lambda: resolve_dataset(
        cfg.data.path, tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.vocab_size, field=cfg.data.field,
        column=cfg.data.column, val_fraction=cfg.data.val_fraction, cache_dir=cfg.data.cache_dir or None))
    dataset = TokenDataset(data_path, tokenizer=cfg.data.tokenizer, verify=cfg.data.verify)
    args = resolve_model_args(cfg.model, vocab_size=dataset.vocab_size, seq_len=cfg.data.seq_len)
    loader = Loader(dataset.split("train"), cfg.data.seq_len, t.batch_size, seed=t.seed,
                    dp_rank=mesh.replica[0], dp_size=mesh.replica[1])
    val_split = dataset.split("val")
    # The validation set is the first eval_batches x batch_size windows whatever the micro-batch size (a memory
    # knob must not change what the loss is measured on), scored one micro-batch at a time.
    micro = t.micro_batch_size or t.batch_size
    val_data = val_batches(val_split, cfg.data.seq_len, micro, t.eval_batches * (t.batch_size // micro)) \
        if val_split.num_windows(cfg.data.seq_len) > 0 else []
    if not val_data and lead:
        warn(f"validation split of {data_path} is shorter than one window of {cfg.data.seq_len + 1} tokens: "
             f"no validation loss")

    resume_from = ckpt.find_resumable(run_dir) if cfg.run.resume else None
    resumed = None
    if resume_from is not None:
        resumed = ckpt.load_state(resume_from)
        info = resumed[1]
        if info["tokenizer_hash"] != dataset.meta["tokenizer_hash"]:
            raise LowbitError(f"run.resume: checkpoint {resume_from} was trained with another tokenizer than "
                              f"the data in {data_path}")
        # The shape must match; how it is computed (checkpointing policy, say) may change on resume.
        shape = {k: v for k, v in dataclasses.asdict(args).items() if k not in RESUMABLE_CHANGES}
        defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING}
        saved = {k: v for k, v in {**defaults, **info["model_args"]}.items() if k not in RESUMABLE_CHANGES}
        if saved != shape:
            raise LowbitError(f"run.resume: checkpoint {resume_from} has model shape {saved}, the config asks "
                              f"for {shape}")
        if info.get("recipe", "bf16") != recipe.name:
            raise LowbitError(f"run.resume: checkpoint {resume_from} was trained with recipe {info['recipe']!r}, "
                              f"the config asks for {recipe.name!r} (their scaling states differ)")
    if cfg.run.tensorboard:
        check_tensorboard()
    config_text = to_toml(cfg)  # a value TOML cannot hold fails here, before the run dir exists
    lead_first(mesh, lambda: prepare_run_dir(run_dir, cfg.run.resume) if lead else None)

    # ---- build ----
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    with torch.device("meta"):  # built without memory, initialized where it trains (seconds at 7b)
        model = Llama(args)
    materialize(model, device)
    n_params, flops_per_token = model.num_params(), model.flops_per_token(cfg.data.seq_len)  # before any split
    conversion = convert(model, recipe)
    model_keys = set(model.state_dict())  # the whole model's, before any split: what a checkpoint must hold
    par = parallelize(model, mesh, cfg.parallel, cfg.data.seq_len, device)
    positions, stage, fp8_gathered, grad_sync = par.positions, par.stage, par.fp8_gathered, par.grad_sync
    tp_group, replicas = par.tp_group, par.replicas
    lp_layers = {name: m for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}
    optimizer = build_optimizer(model, recipe, precision, cfg)
    parallelize_optimizer(optimizer, par, mesh, cfg.parallel)
    zero = par.zero
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.steps, t.warmup_steps, t.min_lr_ratio))

    def restore(path: Path, loaded) -> tuple[int, int]:
        state, info = loaded
        optimizer.load_hyper(state["optimizer"])  # same groups, stored alike: checked before any tensor is read
        # this process's pieces of the whole tensors, read in place (a stage's blocks, a tp shard, a ZeRO share)
        ckpt.load_tensors(path, checkpoint_tensors(model, optimizer, mesh), model_keys)
        if fp8_gathered:  # loaded under the FP8 all-gather's bookkeeping: its amaxes are measured afresh
            precompute_amax(model)
        scheduler.load_state_dict(state["scheduler"])
        if "grad_sync" in state:
            grad_sync.load_state_dict(state["grad_sync"])
        _set_rng_state(state["rng"], device)
        return info["step"], info["tokens_seen"]

    start_step, tokens_seen = 0, 0
    if resumed is not None:
        start_step, tokens_seen = restore(resume_from, resumed)
        if lead:
            truncate_after(run_dir / "metrics.jsonl", start_step)
        say(f"lowbit: resuming from {resume_from} (step {start_step})")
    step_fn = compile_model(model, t.compile_scope) if t.compile else model

    if lead:
        (run_dir / "config.toml").write_text(config_text)
        shutil.copyfile(dataset.tokenizer_path, run_dir / "tokenizer.json")
    metrics = Metrics(run_dir, cfg.run.tensorboard) if lead else _Silent()
    # Optimizer-state telemetry: the lead rank's own states only (ZeRO: its share; pipeline: its stage's), no
    # collectives, so the other ranks skip it.
    param_names = {p: name for name, p in model.named_parameters()} if lead else None

    def autocast():
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=dtype)

    def save_checkpoint(step: int) -> Path:
        state = {"optimizer": optimizer.hyper(), "scheduler": scheduler.state_dict(), "rng": _rng_state(device),
                 "grad_sync": grad_sync.state_dict()}
        # The loader position is the step: the data order is a pure function of (seed, step).
        info = {"step": step, "tokens_seen": tokens_seen, "data_position": {"batch": step, "seed": t.seed,
                                                                            "epoch": loader.epoch_of(step)},
                "model_args": dataclasses.asdict(args),
                "tokenizer_hash": dataset.meta["tokenizer_hash"], "recipe": recipe.name, "config": to_dict(cfg),
                "dataset": str(data_path), "layout": dict(mesh.sizes)}
        # Every process writes its pieces; rank 0 makes the directory, then finishes it (its small files are
        # the same on every rank). Its errors reach every rank, and nobody reads a half-written checkpoint.
        tmp = lead_first(mesh, lambda: ckpt.begin(run_dir, step, lead))
        ckpt.write_tensors(tmp, checkpoint_tensors(model, optimizer, mesh))
        return lead_first(mesh, lambda: ckpt.commit(run_dir, step, tmp, state, info, cfg.checkpoint.keep)
                          if lead else ckpt.checkpoint_root(run_dir) / f"{ckpt.PREFIX}{step:08d}")

    micro = t.micro_batch_size or loader.local_batch  # per replica
    n_micro = loader.local_batch // micro
    pipe, eval_pipe = pipeline_schedules(par, mesh, device, n_micro, cfg.parallel.pp_schedule)
    tokens_per_step = t.batch_size * cfg.data.seq_len
    peak = gpu_peak_flops(device) if dtype == torch.bfloat16 else None
    flops_per_step = flops_per_token * tokens_per_step / mesh.world  # per process: MFU is per GPU
    last_step = t.stop_at or t.steps
    layout = " | " + " x ".join(f"{d} {mesh.sizes[d]}" for d in ("dp", "dp_shard", "cp", "tp", "pp")
                                  if mesh.sizes[d] > 1) \
        if mesh.world > 1 else ""
    say(f"lowbit: {n_params / 1e6:.2f}M parameters ({args.n_layers} layers, dim {args.dim}, vocab "
          f"{args.vocab_size}) | recipe {recipe.name} | {dtype} on {device} | {t.batch_size}x{cfg.data.seq_len} "
          f"tokens/step ({n_micro} micro-batches) | data {data_path} | run {run_dir}{layout}")
    if recipe.linear is not None:
        say(f"lowbit: recipe {recipe.name}: {len(conversion['converted'])} linears in low precision; kept in "
              f"{dtype}: {', '.join(conversion['kept']) or 'none'}")
    if fp8_gathered:
        say(f"lowbit: FSDP2 all-gathers {len(fp8_gathered)} weights as FP8 bytes")

    summary = {"run_dir": str(run_dir), "start_step": start_step, "step": start_step, "loss": None,
               "val_loss": None}
    rolled_back_to: set[Path] = set()

    def rollback(bad_step: int) -> tuple[int, int]:
        """Back to the newest good checkpoint, once per checkpoint: a deterministic replay that fails again
        would only loop."""
        good = ckpt.find_resumable(run_dir) if ckpt.list_checkpoints(run_dir) else None
        if good is None or good in rolled_back_to:
            raise LowbitError(f"{t.rollback_after} consecutive steps with non-finite gradients up to step {bad_step}"
                              f"; {'no checkpoint to roll back to' if good is None else f'already rolled back to {good} once'}"
                              f" (lower train.lr or raise train.warmup_steps; checkpoint.every sets the rollback points)")
        rolled_back_to.add(good)
        back = restore(good, ckpt.load_state(good))
        say(f"lowbit: {t.rollback_after} consecutive bad steps up to step {bad_step}: rolled back to {good} "
              f"(step {back[0]})", flush=True)
        metrics.truncate_after(back[0])  # the steps after it are redone
        metrics.log({"step": back[0], "rollback": {"from": bad_step, "to": back[0], "checkpoint": str(good)}})
        return back

    skipped, bad_run, memory_reported = 0, 0, False
    model.train()
    window_t0, window_tokens, run_t0, timed_steps = time.perf_counter(), 0, None, 0
    step = start_step
    with _StopRequest() as stop:
        while step < last_step:
            step += 1
            x, y = loader.batch(step - 1)
            telemetry_step = n.telemetry_every and (step % n.telemetry_every == 0 or step == 1)
            telemetry = lp_layers and telemetry_step
            for layer in lp_layers.values():
                layer.telemetry_armed = bool(telemetry)
            loss_sum = torch.zeros((), device=device)
            # Telemetry steps run eagerly: their statistics are host-side Python, which torch.compile would have
            # to break the graph for (same numerics either way).
            run_mode = eager if telemetry and t.compile else contextlib.nullcontext
            grad_sync.bytes_sent = 0  # this step's traffic
            context_parallel.SENT["bytes"] = tensor_parallel.SENT["bytes"] = 0
            if zero is not None:
                zero.bytes_sent = 0
            if positions is not None:  # this rank's shard of every sequence (parallel.cp_layout)
                x, y = x[:, positions.cpu()], y[:, positions.cpu()]
            with reports_held():  # the scaling states move on once per step, after every micro-batch
                if pipe is not None:  # the schedule runs every micro-batch through every stage, backward included
                    with autocast(), run_mode():
                        loss_sum = pipeline.run(pipe[0], stage, x.to(device), y.to(device))
                for xm, ym in zip(*((x.split(micro), y.split(micro)) if pipe is None else ((), ()))):
                    with autocast(), run_mode():
                        loss = step_fn(xm.to(device, non_blocking=True), ym.to(device, non_blocking=True),
                                       positions=positions)
                    with run_mode():
                        (loss / n_micro).backward()
                    loss_sum += loss.detach()
            for layer in lp_layers.values():
                layer.telemetry_armed = False
            if cfg.parallel.sequence_parallel:
                sync_partial_grads(model, tp_group)
            grad_sync.sync(optimizer)  # the mean over replicas (nothing in a single process)
            grad_norm = optimizer.clip_grad_norm_(t.grad_clip or float("inf"))
            loss_value = mean_over(loss_sum, replicas).item() / n_micro
            lr = scheduler.get_last_lr()[0]
            finite = math.isfinite(loss_value) and math.isfinite(grad_norm.item())
            if finite:
                bad_run = 0
                optimizer.step()
                if fp8_gathered:  # the next all-gathers' scales, in one all-reduce
                    precompute_amax(model)
                if zero is not None:  # each replica updated its share of the weights: exchange them
                    zero.broadcast()
            else:  # skip the update: nothing non-finite reaches the weights or the optimizer states
                skipped, bad_run = skipped + 1, bad_run + 1
                say(f"lowbit: step {step}: non-finite {'loss' if not math.isfinite(loss_value) else 'gradients'}"
                      f", update skipped ({bad_run} in a row, {skipped} in all)", flush=True)
            scheduler.step()
            if finite and not memory_reported:  # measured once every tensor exists (gradients included)
                report = memory_report(optimizer)
                if lead:
                    (run_dir / "memory.json").write_text(json.dumps(report, indent=1))
                say(format_report(report), flush=True)
                memory_reported = True
            optimizer.zero_grad(set_to_none=True)
            if args.attention == "performer" and args.performer_redraw and step % args.performer_redraw == 0:
                redraw_features(model, seed=t.seed * 1_000_003 + step)  # a function of the step: resumes exactly
            if bad_run >= t.rollback_after:
                step, tokens_seen = rollback(step)
                bad_run = 0
                window_t0, window_tokens = time.perf_counter(), 0
                continue
            tokens_seen += tokens_per_step
            window_tokens += tokens_per_step

            record = {"step": step, "loss": _finite_or_none(loss_value), "lr": lr,
                      "grad_norm": _finite_or_none(grad_norm.item()),
                      "tokens": tokens_seen, **({"comm_bytes": grad_sync.bytes_sent + context_parallel.SENT["bytes"]
                                                  + (zero.bytes_sent if zero is not None else 0)
                                                  + tensor_parallel.SENT["bytes"],
                         "comm_bytes_tp": tensor_parallel.SENT["bytes"],
                         "comm_bytes_grad": grad_sync.bytes_sent, "comm_bytes_cp": context_parallel.SENT["bytes"],
                         **({"comm_bytes_zero": zero.bytes_sent} if zero is not None else {})}
                        if mesh.world > 1 else {}),
                      **({"skipped": not finite, "skipped_steps": skipped} if skipped else {})}
            if step == start_step + 1:  # the first step pays for compilation and warm-up: time from here on
                run_t0, window_t0, window_tokens = time.perf_counter(), time.perf_counter(), 0
            else:
                timed_steps += 1
            if step % t.log_every == 0 or step == last_step:
                now = time.perf_counter()
                tps = window_tokens / max(now - window_t0, 1e-9)
                mfu = tps / tokens_per_step * flops_per_step / peak if peak else None
                per_step = (now - run_t0) / max(timed_steps, 1)
                peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                record.update(tokens_per_s=tps, **({"mfu": mfu} if mfu is not None else {}),
                              **({"peak_mem_gib": peak_gib} if peak_gib is not None else {}))
                say(progress_line(step, t.steps, loss_value, lr, tps, mfu, per_step * (last_step - step), peak_gib),
                      flush=True)
                window_t0, window_tokens = now, 0
            metrics.log(record)
            if telemetry:
                metrics.log({"step": step, "numerics": {name: dict(layer.telemetry)
                                                         for name, layer in lp_layers.items()}})
            if lead and telemetry_step:
                states = optimizer.state_telemetry(param_names)  # {} unless a moment is stored in a scaled kind
                if states:
                    metrics.log({"step": step, "optim_states": states})
            summary.update(step=step, loss=_finite_or_none(loss_value))

            # Read once per step (a signal during validation is seen at the next step), and agreed on by every
            # process: one that stopped alone would leave the others waiting in a collective (checkpoint, step).
            stopping = stop.agreed(device) if mesh.world > 1 else stop.requested
            end = step == last_step or stopping
            pause_t0 = time.perf_counter()  # validation and checkpoints are kept out of tokens/s and the ETA
            if val_data and ((t.eval_every and step % t.eval_every == 0) or end):
                val_loss = evaluate(step_fn, val_data, device, autocast, positions, replicas, eval_pipe)
                metrics.log({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
                say(f"step {step:>6}/{t.steps} | val_loss {val_loss:.4f} | val_ppl {math.exp(min(val_loss, 50)):.2f}",
                      flush=True)
                summary["val_loss"] = val_loss
            if cfg.checkpoint.save and ((cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and finite) or end):
                save_checkpoint(step)
            paused = time.perf_counter() - pause_t0
            window_t0 += paused
            if run_t0 is not None:
                run_t0 += paused
            if stopping:
                say(f"lowbit: stopped by signal after step {step}; " + ("resume with --run.resume" if
                    cfg.checkpoint.save else "nothing saved (checkpoint.save is false)"), flush=True)
                break
    metrics.close()
    if lead and cfg.run.plot:
        plot_losses(metrics.path, run_dir / "loss.png")
    if lead:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
