"""The run configuration's schema: dataclasses <- TOML file <- `--section.key=value` overrides, each field coerced
to its type and checked on its own (choices, ranges); the checks that combine sections are `lowbit.train.plan`'s.

Every field has a default and a one-line help (the `help` metadata); `lowbit train --help` prints them all.
Validation errors are `LowbitError`s that name the key.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowbit.errors import LowbitError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


def opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    preset: str = opt("tiny", "architecture preset: tiny | 125m | 350m | 1b | 7b | 13b; fields below override it")
    dim: int | None = opt(None, "model width (preset)")
    n_layers: int | None = opt(None, "number of transformer blocks (preset)")
    n_heads: int | None = opt(None, "attention heads (preset)")
    n_kv_heads: int | None = opt(None, "key/value heads for grouped-query attention (preset)")
    ffn_dim: int | None = opt(None, "SwiGLU hidden size; unset: 8/3*dim rounded up to ffn_multiple_of (preset)")
    ffn_multiple_of: int | None = opt(None, "rounding multiple of the SwiGLU hidden size (preset)")
    vocab_size: int | None = opt(None, "embedding rows; unset: the tokenizer's vocabulary rounded up to 64 (preset)")
    max_seq_len: int | None = opt(None, "longest sequence the rotary table covers; unset: data.seq_len")
    rope_theta: float | None = opt(None, "rotary embedding base (preset)")
    norm_eps: float | None = opt(None, "RMSNorm epsilon (preset)")
    tie_embeddings: bool | None = opt(None, "share input embedding and output head weights (preset)")
    init_std: float = opt(0.02, "std of the normal init; residual projections get std/sqrt(2*n_layers)")
    attention: str = opt("sdpa", "attention backend: sdpa (exact, flash) | performer (FAVOR+, linear in length)")
    sdpa_backend: str = opt("auto", "sdpa kernel: auto (torch's choice) | cudnn | flash | efficient | math")
    performer_features: int | None = opt(None, "performer random features M; unset: round(d ln d), d the head dim")
    performer_chunk: int = opt(256, "performer causal chunk: positions per masked block (256 was fastest on an H200)")
    performer_redraw: int = opt(1000, "redraw performer features every N steps (saved in checkpoints); 0: never")
    checkpointing: str = opt("none", "activation checkpointing: none | full | selective")
    dropout: float = opt(0.0, "dropout probability of the attention weights and of each block's attention and MLP "
                         "outputs; training only (off in validation and generation)")
    init_from: str = opt("", "start from these weights: a HF Llama directory (config.json + safetensors, as export-hf "
                         "writes) or a lowbit run/checkpoint dir; the shape fields must match them; empty: random init")


@dataclass
class DataConfig:
    path: str = opt("", "prepared dataset dir, or raw text/.jsonl/.parquet file or dir; empty: built-in corpus")
    tokenizer: str = opt("", "tokenizer.json or dir to use; empty: train a byte-level BPE on the corpus")
    vocab_size: int = opt(4096, "vocabulary of a newly trained tokenizer")
    field: str = opt("text", "JSON field holding the text in .jsonl inputs")
    column: str = opt("text", "column holding the text in .parquet inputs")
    val_fraction: float | None = opt(None, "fraction of documents held out for validation when preparing; "
                                           "unset: 0.1 of the built-in corpus, 0.005 of others")
    eos_token: str = opt("", "end-of-document token of data.tokenizer; empty: <|endoftext|>, </s> or <eos>")
    seq_len: int = opt(128, "tokens per training sequence")
    cache_dir: str = opt("", "where prepared datasets are cached; empty: $LOWBIT_CACHE or ~/.cache/lowbit")
    stream: bool = opt(False, "tokenize data.path as training reads it (HF datasets streaming; local files or a Hub "
                              "dataset owner/name[:config]) instead of preparing shards; needs data.tokenizer")
    verify: bool = opt(True, "check shard checksums against meta.json at start")


@dataclass
class TrainConfig:
    steps: int = opt(250, "optimizer steps; also the horizon of the cosine schedule")
    stop_at: int = opt(0, "stop (with a checkpoint) after this step, keeping the schedule of train.steps; 0: off")
    batch_size: int = opt(16, "global batch in sequences per optimizer step, whatever the number of processes")
    micro_batch_size: int = opt(0, "sequences per forward/backward; gradient accumulation covers the rest; 0: all")
    lr: float = opt(1e-3, "peak learning rate")
    min_lr_ratio: float = opt(0.1, "final learning rate as a fraction of the peak")
    warmup_steps: int = opt(25, "linear warm-up steps (from lr/warmup_steps)")
    weight_decay: float = opt(0.1, "AdamW weight decay, applied to tensors of 2+ dims only")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    eps: float = opt(1e-8, "AdamW epsilon")
    grad_clip: float = opt(1.0, "clip the global gradient norm to this; 0: off")
    rollback_after: int = opt(3, "after this many consecutive steps skipped for NaN/Inf gradients, roll back to "
                                 "the last checkpoint")
    dtype: str = opt("auto", "compute dtype: auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16 (autocast)")
    seed: int = opt(0, "seed of initialization and data order")
    compile: bool = opt(False, "torch.compile the model")
    compile_scope: str = opt("blocks", "what one compiled graph holds: blocks (each block and the head on its own; "
                                       "alike blocks share one graph, so compiling costs one block) | model "
                                       "(the whole forward; fuses across blocks, compiles every block)")
    eval_every: int = opt(50, "validation every N steps (and at the end); 0: only at the end")
    eval_batches: int = opt(8, "batches of train.batch_size sequences per validation")
    log_every: int = opt(10, "progress line every N steps")


@dataclass
class NumericsConfig:
    keep_lm_head: bool = opt(True, "low-precision recipes leave the output head in train.dtype")
    keep_first_last: bool = opt(False, "low-precision recipes leave the first and last blocks in train.dtype")
    min_dim: int = opt(0, "linears with in or out features below this stay in train.dtype (too small to gain)")
    keep: str = opt("", "linears that stay in train.dtype, comma-separated: a name's ending ('w2', "
                        "'attention.wo') or a glob over the whole name ('layers.0.*')")
    telemetry_every: int = opt(50, "every N steps record amax, scale, underflow, saturation, SNR per operand; 0: off")
    dge_k: float | None = opt(None, "recipes with DGE (fp4): its sharpness k, 1 = straight-through; unset: the "
                                    "recipe's (5)")
    dge_clamp: float | None = opt(None, "recipes with DGE (fp4): the largest factor it multiplies a weight gradient "
                                        "by; unset: the recipe's (3)")
    occ_products: str = opt("", "recipes with OCC (fp4): how its compensation products are computed: dense (bf16 "
                                "GEMMs), fp8 (FP8 GEMMs), sparse (fp32 sparse products); empty: the recipe's (dense)")
    # The scaling ablations of nanotron and FP8-LM, over every GEMM operand of the recipe's linears
    scaling: str = opt("", "scale strategy of every operand: current | delayed (one scale per tensor only); "
                           "empty: the recipe's")
    history: int | None = opt(None, "delayed operands: amax history length; unset: the recipe's (16 if made delayed)")
    interval: int | None = opt(None, "delayed operands: recompute the scale every N steps; unset: the recipe's")
    margin: int | None = opt(None, "every operand: scale by 2^-margin below fmt.max / amax (headroom); unset: the "
                                   "recipe's (0)")
    fprop_accum: str = opt("", "FP8 forward GEMMs' accumulation on a GPU: fast (Hopper's, without the periodic "
                               "promotion of partial sums to fp32) | precise; empty: the recipe's (fast); the CPU's "
                               "emulation sums in fp32 either way")
    fused_producers: bool = opt(False, "the blocks' RMSNorms and SwiGLU write their output directly as FP8 for the "
                                       "linears reading it (recipes with one current or delayed scale per tensor on the "
                                       "input)")
    fp8_attention: bool = opt(False, "FP8 recipes: causal attention on E4M3 Q, K, V (a scale per head) and P, the "
                                     "backward bf16's at the dequantized operands (docs/numerics.md); off until a "
                                     "convergence study says it is safe")


@dataclass
class OptimConfig:
    weights: str = opt("", "storage of the covered weights: fp32 | bf16 | fp16 (with a per-tensor scale, its own "
                           "master: FP8-LM O2's); empty: the recipe's")
    master: str = opt("", "master copy of the covered weights: none | fp32 | bf16 | fp16 (scaled); empty: the recipe's")
    grads: str = opt("", "covered weight gradients: fp32 | bf16 | e4m3 | e5m2 (scaled); empty: the recipe's")
    exp_avg: str = opt("", "Adam first moment of the covered weights: fp32 | bf16 | e4m3; empty: the recipe's")
    exp_avg_sq: str = opt("", "Adam second moment: fp32 | bf16 | fp16 | e4m3 | e5m2 (scaled); empty: the recipe's")
    rounding: str = opt("", "how the update writes the moments, the master copy and bf16 weights without one: "
                             "nearest | stochastic (unbiased: an E5M2 second moment can decay, small updates to bf16 "
                             "weights add up); empty: the recipe's (nearest)")
    scales: str = opt("", "how the scaled states' new per-tensor scales are chosen: amax (of the new values: two "
                          "passes over memory, MS-AMP's) | bound (from a bound of the new amax by the last step's "
                          "amaxes and the gradient's scale: one pass) | mixed (amax for the FP8 states, bound for "
                          "the FP16 ones: the amax pass computes the FP8 states only, under fp8lm-o2 from the "
                          "gradient and first moment); empty: the recipe's (amax)")
    cuda_graphs: bool = opt(True, "on a GPU, replay the optimizer's update and gradient-norm kernels as CUDA graphs "
                                  "(one launch per step instead of ~40 compiled calls; the same numbers)")


@dataclass
class CheckpointConfig:
    every: int = opt(0, "checkpoint every N steps (and at the end); 0: only at the end")
    keep: int = opt(3, "checkpoints to keep (newest)")
    save: bool = opt(True, "write checkpoints; false: none at all (a throwaway run, or a model whose states the "
                           "disk cannot hold)")


@dataclass
class ParallelConfig:
    dp: int = opt(1, "data-parallel degree (replicas; each takes a slice of the global batch)")
    dp_shard: int = opt(1, "FSDP2 degree (fully_shard): parameters, gradients and optimizer states sharded over "
                           "these replicas, each with its own batch slice; with dp > 1: HSDP")
    fsdp_fp8_gather: bool = opt(True, "with dp_shard: all-gather the weights of fp8-tensorwise linears as FP8 "
                                      "bytes (one scale per tensor, the same numerics)")
    tp: int = opt(1, "tensor-parallel degree (attention heads and MLP width split, Megatron-style)")
    sequence_parallel: bool = opt(False, "with tp: norms and the residual stream split along the sequence "
                                         "(Megatron SP); activations gathered in FP8 under fp8-tensorwise")
    pp: int = opt(1, "pipeline-parallel degree (stages cut between blocks; train.micro_batch_size sets the "
                     "micro-batches)")
    pp_schedule: str = opt("1f1b", "pipeline schedule: gpipe | 1f1b")
    cp: int = opt(1, "context-parallel degree (the sequence split over cp ranks as parallel.cp_layout says)")
    cp_impl: str = opt("ring", "context-parallel attention: ring (online softmax) | rsa (ring self-attention)")
    cp_layout: str = opt("zigzag", "context-parallel sequence split: zigzag (rank r holds chunks r and 2cp-1-r of "
                                   "2cp: causal work balanced) | plain (rank r holds chunk r of cp: the last rank "
                                   "computes cp attention blocks, the first one; ring skips fully masked blocks, rsa only their QK^T)")
    cp_kv_dtype: str = opt("auto", "how K/V travel around the context-parallel ring: auto (the activation dtype, "
                                   "exact) | fp8 (E4M3 bytes, a power-of-two scale per sequence and head: about "
                                   "half of bf16; every rank attends to the dequantized K/V)")
    zero: int = opt(0, "ZeRO stage over the replicas: 0 | 1 (optimizer states sharded, owners broadcast weights)")
    grad_sync: str = opt("fp32", "data-parallel gradient exchange: fp32 | bf16 | fp8 (FP8 bytes, fp32 sums)")
    grad_sync_format: str = opt("e4m3", "FP8 format of the fp8 gradient exchange: e4m3 | e5m2")
    grad_scaling: str = opt("auto", "fp8 gradient exchange scaling (FP8-LM): pre | post | auto")
    timeout_s: int = opt(300, "collective timeout: a rank that fails makes the others stop, not hang")


@dataclass
class RunConfig:
    dir: str = opt("runs/default", "run directory (metrics, checkpoints, plots)")
    resume: bool = opt(False, "continue from the newest good checkpoint in run.dir")
    device: str = opt("auto", "auto | cpu | cuda | cuda:N")
    tensorboard: bool = opt(False, "also write TensorBoard event files to run.dir/tensorboard")
    wandb: bool = opt(False, "also log to Weights & Biases (pip install wandb; WANDB_MODE=offline: no account)")
    wandb_project: str = opt("lowbit", "the W&B project of run.wandb")
    plot: bool = opt(True, "write loss.png at the end of the run")


@dataclass
class Config:
    recipe: str = opt("bf16", "numerics recipe (`lowbit recipes` lists them); bf16: every linear in train.dtype")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)


SECTIONS = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)]


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _base_type(tp):
    """int | None -> (int, True); int -> (int, False)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], True
    return tp, False


def _coerce(key: str, value: Any, tp) -> Any:
    """Turn a TOML value or a command-line string into the field's type, or raise naming the key."""
    base, nullable = _base_type(tp)
    if nullable and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    if isinstance(value, str) and base is not str:
        text = value.strip()
        try:
            if base is bool:
                if text.lower() in ("true", "1", "yes", "on"):
                    return True
                if text.lower() in ("false", "0", "no", "off"):
                    return False
                raise ValueError
            if base is int:
                return int(text)
            if base is float:
                v = float(text)
                if not math.isfinite(v):
                    raise LowbitError(f"{key}: must be a finite number, got {value!r}")
                return v
        except ValueError:
            raise LowbitError(f"{key}: expected {base.__name__}, got {value!r}") from None
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if base is float and isinstance(value, float) and not math.isfinite(value):
        raise LowbitError(f"{key}: must be a finite number, got {value}")
    if not isinstance(value, base) or (base is int and isinstance(value, bool)):
        raise LowbitError(f"{key}: expected {base.__name__}, got {type(value).__name__} {value!r}")
    return value


def _set(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) == 1 and parts[0] in _field_types(Config) and parts[0] not in SECTIONS:
        setattr(cfg, parts[0], _coerce(key, value, _field_types(Config)[parts[0]]))
        return
    if len(parts) != 2 or parts[0] not in SECTIONS:
        raise LowbitError(f"unknown config key {key!r} (sections: {', '.join(SECTIONS)}; see `lowbit train --help`)")
    section = getattr(cfg, parts[0])
    types_ = _field_types(type(section))
    if parts[1] not in types_:
        raise LowbitError(f"unknown config key {key!r} (valid in [{parts[0]}]: {', '.join(types_)})")
    setattr(section, parts[1], _coerce(key, value, types_[parts[1]]))


def flatten_table(table: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in table.items():
        if isinstance(v, dict):
            out += flatten_table(v, f"{prefix}{k}.")
        else:
            out.append((f"{prefix}{k}", v))
    return out


def read_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then `--a.b=c` / `--a.b c` overrides (already split into key, value), each
    field validated (`validate`). `lowbit.train.plan.load_config` checks the whole on top."""
    cfg = Config()
    if path:
        p = Path(path)
        if not p.is_file():
            raise LowbitError(f"config file not found: {path}")
        try:
            table = tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise LowbitError(f"config file {path}: invalid TOML ({e})") from None
        for key, value in flatten_table(table):
            _set(cfg, key, value)
    for key, value in parse_overrides(list(overrides)):
        _set(cfg, key, value)
    validate(cfg)
    return cfg


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """`--a.b=c`, `--a.b c`, and bare `--flag` (true for booleans)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise LowbitError(f"unexpected argument {arg!r} (options look like --section.key=value)")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
            i += 2
        else:
            value = "true"  # a bare flag; _coerce rejects it for non-booleans
            i += 1
        out.append((key.replace("-", "_"), value))
    return out


COMPILE_SCOPES = ("blocks", "model")  # lowbit.train.compile

CHOICES = {
    "model.preset": None,  # filled by models.llama (PRESETS) at validation time
    "model.attention": ("sdpa", "performer"),
    "model.sdpa_backend": ("auto", "cudnn", "flash", "efficient", "math"),
    "numerics.scaling": ("", "current", "delayed"),
    "numerics.occ_products": None,  # filled from numerics.fp4 (PRODUCTS) at validation time
    "numerics.fprop_accum": ("", "fast", "precise"),
    "model.checkpointing": ("none", "full", "selective"),
    "train.compile_scope": COMPILE_SCOPES,
    "train.dtype": ("auto", "fp32", "bf16"),
    "parallel.cp_impl": ("ring", "rsa"),
    "parallel.cp_layout": ("zigzag", "plain"),
    "parallel.cp_kv_dtype": ("auto", "fp8"),
    "parallel.zero": (0, 1),
    "parallel.pp_schedule": ("gpipe", "1f1b"),
    "parallel.grad_sync": ("fp32", "bf16", "fp8"),
    "parallel.grad_sync_format": ("e4m3", "e5m2"),
    "parallel.grad_scaling": ("pre", "post", "auto"),
}

POSITIVE = [
    "model.dim", "model.n_layers", "model.n_heads", "model.n_kv_heads", "model.ffn_dim", "model.ffn_multiple_of",
    "model.vocab_size", "model.max_seq_len", "model.rope_theta", "model.norm_eps", "model.init_std",
    "model.performer_features", "model.performer_chunk",
    "data.vocab_size", "data.seq_len", "train.steps", "train.batch_size", "train.lr", "train.eps",
    "train.eval_batches", "train.log_every", "train.rollback_after", "checkpoint.keep",
    "parallel.dp", "parallel.dp_shard", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.timeout_s",
    "numerics.dge_k", "numerics.dge_clamp", "numerics.history", "numerics.interval",
]
NON_NEGATIVE = [
    "model.performer_redraw",
    "train.stop_at", "train.micro_batch_size", "train.min_lr_ratio", "train.warmup_steps", "train.weight_decay",
    "train.grad_clip", "train.eval_every", "checkpoint.every", "numerics.min_dim", "numerics.telemetry_every",
]


def get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def validate(cfg: Config) -> None:
    """Each field on its own (choices, ranges), and the fields of one section together; what combines sections
    (the recipe with the model, the data and the layout) is the run's plan (`lowbit.train.plan.check`)."""
    from lowbit.models.llama import PRESETS
    from lowbit.numerics.fp4 import PRODUCTS
    from lowbit.numerics.recipes import RECIPES

    choices = dict(CHOICES, **{"model.preset": tuple(PRESETS), "numerics.occ_products": ("", *PRODUCTS)})
    for key, allowed in choices.items():
        if get(cfg, key) not in allowed:
            shown = ", ".join(str(a) if a != "" else "(empty)" for a in allowed)
            raise LowbitError(f"{key}: {get(cfg, key)!r} is not one of {shown}")
    if cfg.recipe not in RECIPES:
        raise LowbitError(f"recipe: {cfg.recipe!r} is not one of {', '.join(RECIPES)}")
    for key in POSITIVE:
        v = get(cfg, key)
        if v is not None and v <= 0:
            raise LowbitError(f"{key}: must be > 0, got {v}")
    for key in NON_NEGATIVE:
        if get(cfg, key) < 0:
            raise LowbitError(f"{key}: must be >= 0, got {get(cfg, key)}")
    if not 0 <= cfg.model.dropout < 1:
        raise LowbitError(f"model.dropout: must be in [0, 1), got {cfg.model.dropout}")
    if cfg.data.val_fraction is not None and not 0 <= cfg.data.val_fraction < 1:
        raise LowbitError(f"data.val_fraction: must be in [0, 1), got {cfg.data.val_fraction}")
    if not (0 <= cfg.train.beta1 < 1 and 0 <= cfg.train.beta2 < 1):
        raise LowbitError("train.beta1/train.beta2: must be in [0, 1)")
    t = cfg.train
    if t.micro_batch_size and t.batch_size % t.micro_batch_size:
        raise LowbitError(f"train.batch_size ({t.batch_size}) must be a multiple of train.micro_batch_size "
                          f"({t.micro_batch_size})")
    if t.stop_at > t.steps:
        raise LowbitError(f"train.stop_at ({t.stop_at}) is beyond train.steps ({t.steps})")
    if not cfg.run.dir:
        raise LowbitError("run.dir: must not be empty")


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (None fields are left out: they mean 'from the preset')."""
    lines = []
    d = to_dict(cfg)
    for k, v in d.items():
        if not isinstance(v, dict):
            lines.append(f"{k} = {_toml_value(v)}")
    for section in SECTIONS:
        lines.append(f"\n[{section}]")
        for k, v in d[section].items():
            if v is not None:
                lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # a basic string: backslash, quote and control characters escaped (TOML 1.0)
        if any("\ud800" <= c <= "\udfff" for c in v):  # undecodable bytes from the command line: no TOML for it
            raise LowbitError(f"config: {v!r} is not valid Unicode (it has bytes that are not UTF-8)")
        return '"' + "".join(c if c not in '\\"' and c.isprintable() else _toml_escape(c) for c in v) + '"'
    return repr(v)


def _toml_escape(c: str) -> str:
    return {"\\": "\\\\", '"': '\\"'}.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x10000 else f"\\U{ord(c):08X}")


def help_text() -> str:
    """Every option with its type, default and meaning."""
    lines = ["options (TOML keys, or --section.key=value on the command line):", ""]
    top = [f for f in dataclasses.fields(Config) if f.name not in SECTIONS]
    for f in top:
        lines.append(f"  --{f.name:<28} {f.default!s:<14} {f.metadata['help']}")
    for section in SECTIONS:
        lines.append(f"\n  [{section}]")
        cls = type(getattr(Config(), section))
        types_ = _field_types(cls)
        for f in dataclasses.fields(cls):
            base, nullable = _base_type(types_[f.name])
            default = "(unset)" if f.default is None else repr(f.default) if isinstance(f.default, str) else f.default
            lines.append(f"  --{section + '.' + f.name:<28} {default!s:<14} {f.metadata['help']} [{base.__name__}]")
    return "\n".join(lines)
