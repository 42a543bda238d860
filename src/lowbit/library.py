"""lowbit as a library for a model and a training loop of one's own: `lowbit.convert`, `lowbit.optimizer`,
`lowbit.unconvert`, `lowbit.plain_state_dict` and `lowbit.telemetry`, re-exported by `lowbit` itself.

Each is a thin door onto what the trainer uses (numerics.recipes' convert and param_groups, LowbitAdamW, the
layers' telemetry), so a user's loop and `lowbit train` get the same numerics from one implementation. A recipe is
given by name or as a Recipe, its module filters as keywords; the filters find the blocks and the output head by
the model's structure, so they work on any module tree (docs/library.md).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.numerics.attention import unswap_attention
from lowbit.numerics.fused_producers import remove_fused_producers
from lowbit.numerics.linear import LowPrecisionLinear
from lowbit.numerics.recipes import Recipe, convert as convert_recipe, get_recipe, param_groups, with_filters
from lowbit.optim.adamw import LowbitAdamW
from lowbit.optim.scaled_weight import ScaledFP16Weight

FILTERS = ("keep_lm_head", "keep_first_last", "min_dim", "keep", "filter", "fp8_attention")


def recipe_with(recipe: str | Recipe, **filters) -> Recipe:
    """The Recipe named `recipe` (or `recipe` itself), with the module filters given as keywords: keep_lm_head,
    keep_first_last, min_dim, keep (names or globs: a tuple, or one string separated by commas) and filter (a
    callable(module, name) that returns False to leave that linear in high precision), and fp8_attention (True: the
    causal attention cores on FP8 operands, lowbit.numerics.attention; FP8 recipes only)."""
    unknown = sorted(set(filters) - set(FILTERS))
    if unknown:
        raise LowbitError(f"{', '.join(unknown)}: not a module filter ({', '.join(FILTERS)} are)")
    if isinstance(recipe, str):
        recipe = get_recipe(recipe)
    elif not isinstance(recipe, Recipe):
        raise LowbitError(f"recipe: expected a recipe name or a lowbit Recipe, got {type(recipe).__name__}")
    if isinstance(filters.get("keep"), list):
        filters["keep"] = tuple(filters["keep"])
    if filters.get("filter") is not None and not callable(filters["filter"]):
        raise LowbitError("filter: expected a callable(module, name) -> bool")
    return with_filters(recipe, **filters)


def convert(model: nn.Module, recipe: str | Recipe, **filters) -> dict[str, list[str]]:
    """Swap `model`'s nn.Linear layers (in place) for the recipe's low-precision ones, except those its filters
    keep; the norms and SwiGLU of a lowbit model also get the recipe's saved-activation codec. Returns
    {"converted": [names], "kept": ["name (reason)"]}. Works on any module tree: keep_first_last keeps the first
    and last of its repeated blocks, found by structure (the nn.ModuleList of one block type holding the most
    parameters), keep_lm_head the linears outside the blocks onto the vocabulary."""
    return convert_recipe(model, recipe_with(recipe, **filters))


def optimizer(model: nn.Module, recipe: str | Recipe, **kwargs) -> LowbitAdamW:
    """LowbitAdamW for `model` after `convert(model, recipe, ...)`: the weights the recipe covers stored as the
    recipe says (FP8-LM's states, FP16 weights...), every other parameter in fp32. Keywords: the module filters
    given to convert (they choose the covered weights of a recipe without low-precision linears, bf16), the rest
    LowbitAdamW's (lr, betas, eps, weight_decay, ...). Build it before the first step: it converts the covered
    weights to their storage in place."""
    filters = {k: kwargs.pop(k) for k in FILTERS if k in kwargs}
    allowed = [k for k in inspect.signature(LowbitAdamW).parameters if k != "params"]
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise LowbitError(f"{', '.join(unknown)}: not an optimizer setting ({', '.join(allowed + list(FILTERS))} "
                          f"are)")
    resolved = recipe_with(recipe, **filters)
    if resolved.linear is not None and not any(isinstance(m, LowPrecisionLinear) for m in model.modules()):
        raise LowbitError(f"optimizer: the model has no low-precision linears; call lowbit.convert(model, "
                          f"{resolved.name!r}) first")
    return LowbitAdamW(param_groups(model, resolved), **kwargs)


def _plain(p: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor: an FP16-with-scale one (optim.weights fp16) as its exact fp32 value."""
    return p.value(torch.float32) if isinstance(p, ScaledFP16Weight) else p


def unconvert(model: nn.Module) -> nn.Module:
    """Undo `convert` (in place; returns the model): every low-precision linear back to an nn.Linear, every weight
    the optimizer stored scaled back to a plain tensor, the FP8 norms and SwiGLU (numerics.fused_producers) back
    to plain ones, no saved-activation codec. The state_dict then holds the
    original keys only (no `*.scaling.*`), so a HF model saves and reloads as plain HF. Meant for the end of
    training: an optimizer built before no longer holds the scaled weights. FP8 attention cores go back to SDPA."""
    remove_fused_producers(model)
    unswap_attention(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, LowPrecisionLinear):
            plain = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            plain.weight, plain.bias = module.weight, module.bias
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
        elif getattr(module, "codec", None) is not None:
            module.codec = None
    for module in model.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if isinstance(p, ScaledFP16Weight):
                setattr(module, key, nn.Parameter(_plain(p).detach(), p.requires_grad))
    return model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state_dict `model` would have unconverted, without changing it: no scaling buffers of the
    low-precision linears, weights stored scaled given as plain fp32 tensors. What a plain model (a HF one, or
    the same class before convert) loads with `load_state_dict(strict=True)`."""
    scaling = tuple(f"{name}.scaling." for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear))
    return {k: _plain(v) for k, v in model.state_dict().items() if not k.startswith(scaling)}


@contextlib.contextmanager
def telemetry(model: nn.Module):
    """Record the low-precision casts made inside the `with` block, forward and backward: yields a dict filled on
    exit with {layer: {operand: {amax, scale, underflow_pct, saturated_pct, snr_db}}} (operands input, weight,
    grad_output), each operand's last cast. Run the step uncompiled: statistics are read out on the host."""
    layers = {name: m for name, m in model.named_modules() if isinstance(m, LowPrecisionLinear)}
    out: dict[str, dict[str, dict]] = {}
    for m in layers.values():
        m.telemetry, m.telemetry_armed = {}, True
    try:
        yield out
    finally:
        for name, m in layers.items():
            m.telemetry_armed = False
            if m.telemetry:
                out[name] = dict(m.telemetry)
