"""A run's inputs, every one checked before anything is written: the dataset, the model shape it gives, the
loader and validation batches, the resume checkpoint (tokenizer, shape, recipe), the config as TOML; then the run
directory is prepared. Also this rank's share of a batch under context parallelism (`this_rank`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from lowbit.data import Loader, TokenDataset, resolve_dataset, val_batches
from lowbit.data.stream import StreamData, StreamLoader, stream_inputs
from lowbit.distributed.mesh import lead_first
from lowbit.errors import LowbitError
from lowbit.models.llama import ModelArgs, resolve_model_args
from lowbit.train import checkpoint as ckpt
from lowbit.train.config import Config, to_toml
from lowbit.train.init_from import RESUMABLE_CHANGES, InitSource, check_init
from lowbit.train.metrics import check_tensorboard, check_wandb, warn



@dataclass
class Inputs:
    """What the checks found: the data, the model shape, the batches, the checkpoint to resume and its state."""

    data_path: Path
    dataset: TokenDataset | StreamData
    args: ModelArgs
    loader: Loader | StreamLoader
    val_data: list
    resume_from: Path | None
    resumed: tuple | None  # (state, info) of resume_from, loaded
    config_text: str
    init: InitSource | None = None  # model.init_from, checked; None when resuming or not asked for


def check_inputs(cfg: Config, mesh, recipe) -> Inputs:
    """Check every input, then prepare the run directory (the first write)."""
    run_dir, lead = Path(cfg.run.dir), mesh.rank == 0
    if cfg.run.wandb:
        check_wandb()
    if cfg.data.stream:
        data_path, dataset, loader, val_data = _stream(cfg, mesh)
    else:
        data_path, dataset, loader, val_data = _prepared(cfg, mesh, lead)
    args = resolve_model_args(cfg.model, vocab_size=dataset.vocab_size, seq_len=cfg.data.seq_len)
    resume_from = ckpt.find_resumable(run_dir) if cfg.run.resume else None
    resumed = None
    if resume_from is not None:
        resumed = ckpt.load_state(resume_from)
        check_resumable(resume_from, resumed[1], dataset, data_path, args, recipe)
        if cfg.data.stream and "stream" not in resumed[1].get("data_position", {}):
            raise LowbitError(f"run.resume: checkpoint {resume_from} was not trained with data.stream (it holds "
                              f"no stream position)")
    init = check_init(cfg.model.init_from, args, dataset.meta["tokenizer_hash"]) \
        if cfg.model.init_from and resumed is None else None
    if cfg.run.tensorboard:
        check_tensorboard()

    config_text = to_toml(cfg)  # a value TOML cannot hold fails here, before the run dir exists
    lead_first(mesh, lambda: prepare_run_dir(run_dir, cfg.run.resume) if lead else None)
    return Inputs(data_path, dataset, args, loader, val_data, resume_from, resumed, config_text, init)


def _prepared(cfg: Config, mesh, lead: bool) -> tuple:
    """A prepared dataset (raw data prepared into the cache first), its loader and validation batches."""
    data_path = lead_first(mesh, lambda: resolve_dataset(
        cfg.data.path, tokenizer=cfg.data.tokenizer, vocab_size=cfg.data.vocab_size, field=cfg.data.field,
        column=cfg.data.column, val_fraction=cfg.data.val_fraction, cache_dir=cfg.data.cache_dir or None,
        eos_token=cfg.data.eos_token))
    dataset = TokenDataset(data_path, tokenizer=cfg.data.tokenizer, verify=cfg.data.verify)
    t = cfg.train
    loader = Loader(dataset.split("train"), cfg.data.seq_len, t.batch_size, seed=t.seed,
                    dp_rank=mesh.replica[0], dp_size=mesh.replica[1])
    return data_path, dataset, loader, _validation_batches(cfg, dataset, data_path, lead)


def _stream(cfg: Config, mesh) -> tuple:
    """data.stream: documents tokenized as read; validation is the stream's first eval_batches x batch_size
    windows, scored one micro-batch at a time."""
    d, t = cfg.data, cfg.train
    if not d.path:
        raise LowbitError("data.stream needs data.path: files or a Hub dataset to stream")
    dataset = StreamData(d.path, d.tokenizer, d.eos_token)
    micro = t.micro_batch_size or t.batch_size
    loader, val_data = stream_inputs(dataset, d.path, d.seq_len, t.batch_size, t.eval_batches * t.batch_size,
                                     micro, d.field, d.column, dp_rank=mesh.replica[0], dp_size=mesh.replica[1])
    return Path(d.path), dataset, loader, val_data


def _validation_batches(cfg: Config, dataset: TokenDataset, data_path: Path, lead: bool) -> list:
    """The validation set is eval_batches x batch_size windows spread over the split whatever the micro-batch size
    (a memory knob must not change what the loss is measured on), scored one micro-batch at a time."""
    t = cfg.train
    val_split = dataset.split("val")
    micro = t.micro_batch_size or t.batch_size
    val_data = val_batches(val_split, cfg.data.seq_len, micro, t.eval_batches * (t.batch_size // micro)) \
        if val_split.num_windows(cfg.data.seq_len) > 0 else []
    if not val_data and lead:
        warn(f"validation split of {data_path} is shorter than one window of {cfg.data.seq_len + 1} tokens: "
             f"no validation loss")
    return val_data


def check_resumable(resume_from: Path, info: dict, dataset: TokenDataset, data_path: Path, args: ModelArgs,
                    recipe) -> None:
    """The checkpoint was trained on this tokenizer, with this model shape and recipe."""
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
    for name, is_dir in RUN_FILES.items():  # found now, not when the first checkpoint or the summary is written
        path = run_dir / name
        if path.exists() and path.is_dir() != is_dir:
            raise LowbitError(f"run.dir: {path} is a {'file' if is_dir else 'directory'}, where the run writes its "
                              f"{'directory' if is_dir else 'file'}; remove it or choose another --run.dir")


RUN_FILES = {"config.toml": False, "tokenizer.json": False, "metrics.jsonl": False, "summary.json": False,
             "loss.png": False, "memory.json": False, "checkpoints": True, "wandb": True}  # name: whether it is a directory


def this_rank(x, y, positions):
    """This rank's shard of every sequence under context parallelism (`positions`, parallel.cp_layout); the
    batch itself otherwise."""
    if positions is None:
        return x, y
    return x[:, positions.cpu()], y[:, positions.cpu()]
