"""lowbit: pretrain LLaMA-style language models in low precision (FP8, FP4)."""

from lowbit.errors import LowbitError

__version__ = "0.1.0"
__all__ = ["LowbitError", "__version__"]
