"""Named numerics recipes and `convert(model, recipe)`, which swaps a plain model's linears for low-precision ones.

A recipe is data (a frozen dataclass), not a code path. The low-precision recipes (FP8, FP8-LM, FP4) arrive with
the numerics core; `bf16` is the baseline every one of them is compared against.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lowbit.errors import LowbitError


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str


RECIPES: dict[str, Recipe] = {
    "bf16": Recipe("bf16", "baseline: every linear computes in train.dtype (bf16 autocast on GPU)"),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise LowbitError(f"recipe: {name!r} is not one of {', '.join(RECIPES)}")
    return RECIPES[name]


def convert(model: nn.Module, recipe: Recipe) -> nn.Module:
    """Apply `recipe` to `model` in place and return it. The baseline (the only recipe so far) leaves every
    nn.Linear as it is; low-precision recipes will swap eligible linears here."""
    return model
