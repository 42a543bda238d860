"""The run's plan: a config checked as a whole, once, before anything is built or read. `resolve_recipe` is the
one place the recipe and its optimizer storage are resolved; `check` runs every check that combines sections
(model, data, numerics, optim, parallel); `load_config` reads a config (`config.read_config`) and checks it.
"""

from __future__ import annotations

import dataclasses

import torch

from lowbit.distributed.mesh import check_layout
from lowbit.errors import LowbitError
from lowbit.models.llama import Llama, resolve_model_args
from lowbit.numerics.fused_producers import unsupported
from lowbit.numerics.recipes import (Recipe, check_keep, get_recipe, is_fp8, keep_patterns, with_dge, with_filters,
                                    with_fprop_accum, with_occ_products, with_scaling)
from lowbit.optim.precision import StatePrecision
from lowbit.train.config import Config, read_config


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file, then `--a.b=c` / `--a.b c` overrides, each field validated
    (`config.read_config`), then the whole checked (`check`): the config of a run, a compare or a bench."""
    cfg = read_config(path, overrides)
    check(cfg)
    return cfg


def check(cfg: Config) -> Recipe:
    """Every check across sections, raising a LowbitError that names the keys; returns the resolved Recipe.
    numerics.keep is normalized on the way (`_check_keep`)."""
    _check_keep(cfg)
    recipe = resolve_recipe(cfg)  # raises naming the [numerics] or [optim] key it cannot apply
    if recipe.needs_grad_clip and not cfg.train.grad_clip:
        raise LowbitError(f"train.grad_clip: recipe {cfg.recipe} needs gradient clipping (> 0)")
    if cfg.model.attention != "sdpa" and cfg.model.sdpa_backend != "auto":
        raise LowbitError(f"model.sdpa_backend ({cfg.model.sdpa_backend}): model.attention is "
                          f"{cfg.model.attention}, which runs no SDPA kernel")
    if cfg.model.dropout:
        _check_dropout(cfg)
    if cfg.numerics.fused_producers:
        _check_fused_producers(cfg, recipe)
    if cfg.numerics.fp8_attention:
        _check_fp8_attention(cfg, recipe)
    # Shape checks (dim % heads, heads % kv-heads) need the preset merged: models.llama does them.
    args = resolve_model_args(cfg.model, vocab_size=cfg.model.vocab_size or 256, seq_len=cfg.data.seq_len)
    check_layout(cfg, args, recipe.optim)
    return recipe


def _check_dropout(cfg: Config) -> None:
    """Dropout runs in the exact attention (SDPA's dropout_p) and on the residual branches, under dp, dp_shard and
    pp; the attention cores that have none, and tensor parallelism, whose ranks draw one RNG stream (so their head
    shards would drop alike), are refused."""
    why = {"model.attention performer": (cfg.model.attention != "sdpa", "FAVOR+ attention has no attention dropout"),
           "parallel.cp > 1": (cfg.parallel.cp > 1, "the ring attention has no attention dropout"),
           "parallel.tp > 1": (cfg.parallel.tp > 1, "the ranks draw one RNG stream, so their shards would drop "
                                                     "alike")}
    for key, (found, reason) in why.items():
        if found:
            raise LowbitError(f"model.dropout ({cfg.model.dropout}): not with {key} ({reason}); set model.dropout 0")


def _check_fused_producers(cfg: Config, recipe: Recipe) -> None:
    """numerics.fused_producers writes the norms' and SwiGLU's output as FP8 with the scale of the linears that
    read it: their input must be cast with one current or delayed scale per tensor of the whole tensor (not a
    rank's shard)."""
    why = "it has no low-precision linears" if recipe.linear is None else unsupported(recipe.linear)
    if why:
        raise LowbitError(f"numerics.fused_producers: not with recipe {cfg.recipe}: {why}; set "
                          f"numerics.fused_producers=false")
    if cfg.parallel.tp > 1:
        raise LowbitError("numerics.fused_producers: not with parallel.tp > 1 (a producer's amax would be one "
                          "rank's shard's); set numerics.fused_producers=false")


def _check_fp8_attention(cfg: Config, recipe: Recipe) -> None:
    """numerics.fp8_attention replaces the exact causal SDPA core: not the ring's, FAVOR+'s or one with dropout,
    and only beside FP8 linears."""
    why = {"parallel.cp > 1": (cfg.parallel.cp > 1, "the ring attention runs its own blocks"),
           "model.attention performer": (cfg.model.attention != "sdpa", "FAVOR+ has no softmax attention"),
           "model.dropout > 0": (cfg.model.dropout > 0, "the FP8 kernel has no attention dropout"),
           f"recipe {cfg.recipe}": (not is_fp8(recipe), "its linears are not FP8; pick an FP8 recipe")}
    for key, (found, reason) in why.items():
        if found:
            raise LowbitError(f"numerics.fp8_attention: not with {key} ({reason})")


def _check_keep(cfg: Config) -> None:
    """numerics.keep, normalized (a config that differs only in spacing or repeats is the same config), against
    the linears of the configured model: built on the meta device (no memory, no data: the vocabulary is a
    stand-in), so a pattern naming nothing fails before any data is read or directory written."""
    keep = keep_patterns(cfg.numerics.keep)
    cfg.numerics.keep = ",".join(keep)
    if keep:
        with torch.device("meta"):
            model = Llama(resolve_model_args(cfg.model, vocab_size=1, seq_len=cfg.data.seq_len))
        check_keep(model, keep)


def resolve_recipe(cfg: Config) -> Recipe:
    """The run's Recipe, resolved once for the trainer, bench and compare alike: the named one with the
    [numerics] module filters, DGE and scaling settings applied, and its optimizer storage with the [optim] fields
    that are set."""
    n = cfg.numerics
    recipe = with_filters(get_recipe(cfg.recipe), keep_lm_head=n.keep_lm_head, keep_first_last=n.keep_first_last,
                          min_dim=n.min_dim, keep=n.keep, fp8_attention=n.fp8_attention)
    recipe = with_scaling(with_occ_products(with_dge(recipe, n.dge_k, n.dge_clamp), n.occ_products), n.scaling,
                          n.history, n.interval, n.margin)
    recipe = dataclasses.replace(with_fprop_accum(recipe, n.fprop_accum), fused_producers=n.fused_producers)
    fields = {f.name for f in dataclasses.fields(StatePrecision)}
    over = {k: v for k, v in dataclasses.asdict(cfg.optim).items() if v and k in fields}
    return dataclasses.replace(recipe, optim=StatePrecision(**{**dataclasses.asdict(recipe.optim), **over}))


def optim_precision(cfg: Config) -> StatePrecision:
    """The covered weights' StatePrecision (resolve_recipe's)."""
    return resolve_recipe(cfg).optim
