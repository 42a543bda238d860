"""Cosine similarity of each recipe's linear layer to the fp64 reference (fprop output, dgrad, wgrad) on
LLaMA-shaped random inputs: 512 tokens, 1024 -> 2816 (a SwiGLU up-projection), activations with outlier channels.

    python benchmarks/numerics_fidelity.py      # prints the markdown table recorded in docs/numerics.md
"""

import datetime
import sys

import torch

from lowbit.numerics.recipes import RECIPES
from lowbit.tools.fidelity import linear_fidelity

print(f"{datetime.date.today()} | torch {torch.__version__} | `python {' '.join(sys.argv)}`\n")
print("| recipe | fprop y | dgrad dx | wgrad dW |")
print("|---|---|---|---|")
for name in RECIPES:
    f = linear_fidelity(name)
    print(f"| {name} | {f['fprop']:.5f} | {f['dgrad']:.5f} | {f['wgrad']:.5f} |")
