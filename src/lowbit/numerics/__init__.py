"""The numerics layer under the model: formats and exact casts (formats, qtensor), scaling (scaling), the scaled
GEMMs (gemm, kernels), the low-precision linear and its FP4 parts (linear, fp4, activations), and recipes as data
that convert a model's linears (recipes). The model itself knows nothing of it."""

from lowbit.numerics.recipes import RECIPES, Recipe, convert, get_recipe

__all__ = ["RECIPES", "Recipe", "convert", "get_recipe"]
