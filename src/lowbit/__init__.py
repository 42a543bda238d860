"""lowbit: pretrain LLaMA-style language models in low precision (FP8, FP4)."""

from lowbit.errors import LowbitError
from lowbit.reproducible import pin_cpu_numerics

pin_cpu_numerics()  # before torch loads MKL: the same command gives the same bits on a CPU

__version__ = "0.1.0"
__all__ = ["LowbitError", "__version__"]
