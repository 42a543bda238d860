"""lowbit: pretrain LLaMA-style language models in low precision (FP8, FP4).

The library's names (`lowbit.convert`, `lowbit.optimizer`, ...: docs/library.md) load on first use, so that
`import lowbit` stays light (no torch) and pins the CPU numerics before torch loads MKL."""

import importlib

from lowbit.errors import LowbitError
from lowbit.reproducible import pin_cpu_numerics

pin_cpu_numerics()  # before torch loads MKL: the same command gives the same bits on a CPU

__version__ = "0.1.0"

_LAZY = {
    "convert": "lowbit.library", "optimizer": "lowbit.library", "unconvert": "lowbit.library",
    "plain_state_dict": "lowbit.library", "telemetry": "lowbit.library", "recipe_with": "lowbit.library",
    "Recipe": "lowbit.numerics.recipes", "RECIPES": "lowbit.numerics.recipes", "get_recipe": "lowbit.numerics.recipes",
    "LowPrecisionLinear": "lowbit.numerics.linear", "LowbitAdamW": "lowbit.optim.adamw",
    "StatePrecision": "lowbit.optim.precision", "memory_report": "lowbit.optim.memory",
}
__all__ = ["LowbitError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'lowbit' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
