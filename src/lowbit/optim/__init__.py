"""Optimizers and schedules: AdamW with per-state storage precision, FP8 gradient scaling, LR schedules."""

from lowbit.optim.adamw import GradStore, LowbitAdamW
from lowbit.optim.grad_scaling import AutoScale, fp8_sum
from lowbit.optim.memory import memory_report
from lowbit.optim.precision import StatePrecision
from lowbit.optim.schedule import lr_lambda

__all__ = ["AutoScale", "GradStore", "LowbitAdamW", "StatePrecision", "fp8_sum", "lr_lambda", "memory_report"]
