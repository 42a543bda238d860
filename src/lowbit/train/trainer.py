"""The trainer: `train(cfg)` checks every input, builds the model, converts it (numerics), parallelizes it, builds
the optimizer, restores a checkpoint, then runs the loop of `train_step` / `validate` / `save_checkpoint` and
reports each step.

Nothing is written to the run directory until every input has been checked (config, data, tokenizer, resume
checkpoint), so a failed start leaves what is on disk as it was.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import signal

import torch

from lowbit.distributed import pipeline
from lowbit.distributed.mesh import init_mesh, local_device, mean_over, micro_batch
from lowbit.distributed.parallelize import parallelize, parallelize_optimizer, pipeline_schedules
from lowbit.errors import LowbitError
from lowbit.models.init import materialize
from lowbit.models.llama import Llama
from lowbit.numerics.linear import LowPrecisionLinear
from lowbit.numerics.recipes import convert, param_groups
from lowbit.optim import LowbitAdamW, StatePrecision, lr_lambda
from lowbit.train.compile import compile_model
from lowbit.train.config import Config, to_dict
from lowbit.train.plan import resolve_recipe
from lowbit.train.init_from import load_init
from lowbit.train.inputs import check_inputs, this_rank
from lowbit.train.metrics import Metrics, plot_losses, truncate_after, warn
from lowbit.train.report import Clock, report_step
from lowbit.train.snapshot import restore, save_checkpoint
from lowbit.train.state import Run
from lowbit.train.step import train_step


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
    """AdamW over `param_groups`: the weights of the linears the recipe covers with its storage precision,
    everything else fp32; weight decay on 2+-dim tensors only."""
    t = cfg.train
    return LowbitAdamW(param_groups(model, recipe, precision), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                       weight_decay=t.weight_decay, cuda_graphs=cfg.optim.cuda_graphs)


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

    def track(self, record: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


@torch.no_grad()
def evaluate(model, batches, device, autocast, positions=None, group=None, pipe=None) -> float:
    """Mean validation loss; with context parallelism each rank scores its shard and the ranks average; with
    pipeline parallelism (`pipe(b)`: the schedule, stage module and micro-batches for a batch of b) the stages run
    it together."""
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=device), 0
    for x, y in batches:
        b = x.shape[0]  # each sequence weighs the same, also in a smaller last batch
        count += b
        x, y = this_rank(x, y, positions)
        with autocast():
            if pipe is not None:
                sched, stage, n = pipe(x.shape[0])
                total += pipeline.run(sched, stage, x.to(device), y.to(device), train=False) / n * b
            else:
                total += model(x.to(device), y.to(device), positions=positions).float() * b
    model.train(was_training)
    return mean_over(total, group).item() / max(1, count)


def train(cfg: Config) -> dict:
    """Train according to `cfg`; returns a summary (final step, losses, run dir)."""
    recipe = resolve_recipe(cfg)
    device, dtype, mesh = _start(cfg, recipe)
    inputs = check_inputs(cfg, mesh, recipe)  # the run directory is prepared last, once every input passed
    model = build_model(inputs.args, cfg.train.seed, device)
    if inputs.init is not None:  # before convert and parallelize: every recipe and layout starts from them
        load_init(inputs.init, model)
    n_params, flops_per_token = model.num_params(), model.flops_per_token(cfg.data.seq_len)  # before any split
    conversion = convert(model, recipe)
    model_keys = set(model.state_dict())  # the whole model's, before any split: what a checkpoint must hold
    par = parallelize(model, mesh, cfg.parallel, cfg.data.seq_len, device)
    lp_layers = {name: m for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}
    optimizer = build_optimizer(model, recipe, recipe.optim, cfg)
    parallelize_optimizer(optimizer, par, mesh, cfg.parallel)
    t = cfg.train
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t.steps, t.warmup_steps, t.min_lr_ratio))
    run = Run(cfg, recipe, device, dtype, mesh, inputs, model, model_keys, flops_per_token, par, lp_layers,
              optimizer, scheduler)
    if inputs.resumed is not None:
        _resume(run)
    _open(run)
    _announce(run, n_params, conversion)
    _loop(run)
    return _finish(run)


def _start(cfg: Config, recipe) -> tuple[torch.device, torch.dtype, object]:
    """The device, the compute dtype and the mesh, with the checks that need the device."""
    device = local_device(resolve_device(cfg.run.device))
    dtype = compute_dtype(cfg.train.dtype, device)
    if device.type != "cuda" and cfg.model.sdpa_backend in ("cudnn", "efficient"):
        raise LowbitError(f"model.sdpa_backend: {cfg.model.sdpa_backend} runs on CUDA only, not on {device}")
    mesh = init_mesh(cfg.parallel, device)
    precision = recipe.optim
    if recipe.linear is None and precision.weights != "fp32" and dtype == torch.float32:
        raise LowbitError(f"optim.weights: {precision.weights} weights in high-precision linears need autocast "
                          f"(train.dtype bf16)")
    return device, dtype, mesh


def build_model(args, seed: int, device: torch.device) -> Llama:
    """The Llama of `args`, initialized on `device` from the run's seed."""
    torch.manual_seed(seed)
    random.seed(seed)
    with torch.device("meta"):  # built without memory, initialized where it trains (seconds at 7b)
        model = Llama(args)
    materialize(model, device)
    return model


def _resume(run: Run) -> None:
    inputs = run.inputs
    run.start_step, run.tokens_seen = restore(run, inputs.resume_from, inputs.resumed)
    if run.lead:
        truncate_after(run.run_dir / "metrics.jsonl", run.start_step)
    run.say(f"lowbit: resuming from {inputs.resume_from} (step {run.start_step})")


def _open(run: Run) -> None:
    """Compile the model, write the run files, open the metrics, size the micro-batches, build the pipeline
    schedules."""
    cfg, t = run.cfg, run.cfg.train
    run.step_fn = compile_model(run.model, t.compile_scope) if t.compile else run.model
    if run.lead:
        (run.run_dir / "config.toml").write_text(run.inputs.config_text)
        shutil.copyfile(run.inputs.dataset.tokenizer_path, run.run_dir / "tokenizer.json")
    wandb = {"project": cfg.run.wandb_project, "config": to_dict(cfg)} if cfg.run.wandb else None
    run.metrics = Metrics(run.run_dir, cfg.run.tensorboard, wandb) if run.lead else _Silent()
    # Optimizer-state telemetry: the lead rank's own states only (ZeRO: its share; pipeline: its stage's), no
    # collectives, so the other ranks skip it.
    run.param_names = {p: name for name, p in run.model.named_parameters()} if run.lead else None
    loader = run.inputs.loader
    run.micro = micro_batch(cfg, loader.local_batch)  # per replica
    run.n_micro = loader.local_batch // run.micro
    run.pipe, run.eval_pipe = pipeline_schedules(run.par, run.mesh, run.device, run.n_micro, cfg.parallel.pp_schedule)
    run.step = run.start_step
    run.summary = {"run_dir": str(run.run_dir), "start_step": run.start_step, "step": run.start_step, "loss": None,
                   "val_loss": None}


def _announce(run: Run, n_params: int, conversion: dict) -> None:
    """The run's one-line description, the recipe's coverage, the FP8 all-gathers."""
    cfg, t, mesh, args = run.cfg, run.cfg.train, run.mesh, run.inputs.args
    layout = " | " + " x ".join(f"{d} {mesh.sizes[d]}" for d in ("dp", "dp_shard", "cp", "tp", "pp")
                                  if mesh.sizes[d] > 1) \
        if mesh.world > 1 else ""
    run.say(f"lowbit: {n_params / 1e6:.2f}M parameters ({args.n_layers} layers, dim {args.dim}, vocab "
            f"{args.vocab_size}) | recipe {run.recipe.name} | {run.dtype} on {run.device} | "
            f"{t.batch_size}x{cfg.data.seq_len} tokens/step ({run.n_micro} micro-batches) | data "
            f"{run.inputs.data_path} | run {run.run_dir}{layout}")
    if run.recipe.linear is not None:
        run.say(f"lowbit: recipe {run.recipe.name}: {len(conversion['converted'])} linears in low precision; kept "
                f"in {run.dtype}: {', '.join(conversion['kept']) or 'none'}")
    if "fused" in conversion:
        run.say(f"lowbit: numerics.fused_producers: {len(conversion['fused'])} norms and SwiGLUs write FP8; "
                f"unfused: {', '.join(conversion['unfused']) or 'none'}")
    if run.par.fp8_gathered:
        run.say(f"lowbit: FSDP2 all-gathers {len(run.par.fp8_gathered)} weights as FP8 bytes")


def _loop(run: Run) -> None:
    """Steps until the last one or a stop signal: each trained, reported, validated and checkpointed when due."""
    cfg, t = run.cfg, run.cfg.train
    run.model.train()
    clock = Clock(run)
    with _StopRequest() as stop:
        while run.step < run.last_step:
            run.step += 1
            result = train_step(run)
            if result.rolled_back:
                clock.restart_window()
                continue
            report_step(run, result, clock)
            # Read once per step (a signal during validation is seen at the next step), and agreed on by every
            # process: one that stopped alone would leave the others waiting in a collective (checkpoint, step).
            stopping = stop.agreed(run.device) if run.mesh.world > 1 else stop.requested
            end = run.step == run.last_step or stopping
            with clock.paused():  # validation and checkpoints are kept out of tokens/s and the ETA
                validate(run, end)
                every = cfg.checkpoint.every
                if cfg.checkpoint.save and ((every and run.step % every == 0 and result.finite) or end):
                    save_checkpoint(run, run.step)
            if stopping:
                run.say(f"lowbit: stopped by signal after step {run.step}; " + ("resume with --run.resume" if
                        cfg.checkpoint.save else "nothing saved (checkpoint.save is false)"), flush=True)
                break


def validate(run: Run, end: bool) -> None:
    """The validation loss every train.eval_every steps and at the end, logged and printed."""
    t, step = run.cfg.train, run.step
    if run.inputs.val_data and ((t.eval_every and step % t.eval_every == 0) or end):
        val_loss = evaluate(run.step_fn, run.inputs.val_data, run.device, run.autocast, run.par.positions,
                            run.par.replicas, run.eval_pipe)
        run.metrics.log({"step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 50))})
        run.say(f"step {step:>6}/{t.steps} | val_loss {val_loss:.4f} | val_ppl {math.exp(min(val_loss, 50)):.2f}",
                flush=True)
        run.summary["val_loss"] = val_loss


def _finish(run: Run) -> dict:
    run.metrics.close()
    if run.lead and run.cfg.run.plot:
        plot_losses(run.metrics.path, run.run_dir / "loss.png")
    if run.lead:
        (run.run_dir / "summary.json").write_text(json.dumps(run.summary, indent=1))
        _warn_if_diverged(run)
    return run.summary


def _warn_if_diverged(run: Run) -> None:
    """A run that ends worse than a uniform guess over the vocabulary (loss ln V) has diverged: said on one line,
    with what usually causes it, though the run itself finished."""
    loss, vocab = run.summary.get("loss"), run.inputs.args.vocab_size
    if loss is not None and not loss < 1.5 * math.log(vocab):
        warn(f"the training loss ended at {loss:.4g}, above the {math.log(vocab):.2f} of a uniform guess over "
             f"{vocab} tokens: the run diverged; lower train.lr (now {run.cfg.train.lr:g}) or set train.grad_clip "
             f"(now {run.cfg.train.grad_clip:g})")
