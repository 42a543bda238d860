"""`lowbit bench gemm | linear | mlp | block | step | memory | optim | attention`: bf16, lowbit's recipes and (where installed)
float8 recipes measured in one process; each prints its tables with the device, torch version, date and command,
and --out writes them as JSON with the same metadata.

Defaults follow the device: on a GPU the shapes of the project's goals (LLaMA-7B MLP at 16384 tokens, the `1b`
preset at batch 8 x 2048, compiled, CUDA-event medians); on the CPU tiny shapes, eager, a wall-clock timer (a smoke
test, not a measurement worth quoting)."""

from __future__ import annotations

import argparse
import sys

from lowbit.errors import LowbitError
from lowbit.train.config import COMPILE_SCOPES

WHAT = {
    "gemm": "torch._scaled_mm FP8 vs the bf16 matmul on the MLP's GEMM shapes",
    "linear": "one linear layer fwd+bwd per recipe",
    "mlp": "the SwiGLU MLP fwd+bwd per recipe, and per-tensor quantization",
    "block": "one LLaMA block of a preset fwd+bwd per recipe",
    "kernels": "quantization kernels: per-tensor quantize, fused cast + transpose, against the memory floor",
    "step": "a training step of a preset per recipe: tokens/s, MFU, peak memory",
    "memory": "bytes saved for backward by a preset's forward per recipe, and peak memory",
    "optim": "the optimizer step alone per recipe on a preset's parameters: ms, GB/s against the bytes it moves",
    "attention": "causal attention fwd and fwd+bwd per sequence length: SDPA bf16 (flash) against lowbit's FP8",
}

# (GPU default, CPU default) of each shape option
DEFAULTS = {"seqs": ("2048,4096,8192,16384", "64,128"), "heads": (32, 2), "head_dim": (128, 32),
            "tokens": (16384, 256), "dim": (4096, 256), "hidden": (11008, 768), "preset": ("1b", "tiny"),
            "batch": (8, 2), "seq": (2048, 64), "vocab": (32000, 512), "steps": (20, 3), "warmup": (5, 1)}


def _common(p: argparse.ArgumentParser, what: str) -> None:
    """The options `what` reads, and no others (gemm times fixed kernels: no recipes, nothing to compile; memory
    counts one forward: nothing to time)."""
    if what not in ("gemm", "kernels", "attention"):
        p.add_argument("--recipes", default="bf16,fp8-tensorwise",
                       help="lowbit recipes, comma-separated (bf16 is measured first unless --no-bf16: ratios are "
                            "to it)" + ("; an entry RECIPE+section.key=value trains with that setting, e.g. "
                                        "fp8lm-o2+optim.cuda_graphs=false" if what == "step" else ""))
        p.add_argument("--torchao", default="tensorwise",
                       help="torchao float8 recipes beside them (tensorwise, rowwise, rowwise_with_gw_hp; 'none' for "
                            "none); skipped with one line when torchao is not installed")
    if what != "kernels":
        p.add_argument("--no-bf16", action="store_true",
                       help="skip the bf16 baseline (no ratios then: for a run that must fit a time limit)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    if what != "memory":
        quantize = " (50 for the quantization timing: its kernels take microseconds)" if what in ("mlp", "kernels") \
            else ""
        p.add_argument("--steps", type=int, default=None,
                       help=f"timed iterations (GPU 20{quantize}, CPU 3); median reported")
        p.add_argument("--warmup", type=int, default=None, help="untimed iterations first (GPU 5, CPU 1)")
    if what != "gemm":
        mode = p.add_mutually_exclusive_group()
        mode.add_argument("--compile", dest="compile", action="store_true", default=None,
                          help="torch.compile the module (default on a GPU)")
        mode.add_argument("--eager", dest="compile", action="store_false",
                          help="no torch.compile (default on the CPU)")
    p.add_argument("--out", default="", help="write the tables and metadata as JSON here")


def _mlp_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="rows of the input (GPU 16384, CPU 256)")
    p.add_argument("--dim", type=int, default=None, help="model dimension (GPU 4096 = LLaMA-7B, CPU 256)")
    p.add_argument("--hidden", type=int, default=None, help="MLP hidden width (GPU 11008 = LLaMA-7B, CPU 768)")


def _kernel_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=None, help="rows of the tensor (GPU 16384, CPU 256)")
    p.add_argument("--dim", type=int, default=None, help="its columns (GPU 4096, CPU 256)")
    p.add_argument("--hidden", type=int, default=None, help="the SwiGLU's width, for the fused producers (GPU 11008, "
                                                          "CPU 768)")


def _attention_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", default=None, help="sequence lengths, comma-separated (GPU 2048,4096,8192,16384; CPU "
                                                "64,128)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per batch: batch = tokens // seq, at least 1 "
                                                            "(GPU 16384, CPU 256)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (GPU 32, CPU 2)")
    p.add_argument("--head-dim", type=int, default=None, help="head size (GPU 128, CPU 32)")


def _preset_shape(p: argparse.ArgumentParser, vocab: bool) -> None:
    p.add_argument("--preset", default=None, help="model preset (GPU 1b, CPU tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (GPU 8, CPU 2)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (GPU 2048, CPU 64)")
    if vocab:
        p.add_argument("--vocab", type=int, default=None, help="vocabulary (GPU 32000, CPU 512; presets with a "
                                                                  "fixed vocabulary keep theirs)")


def add_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="{" + ",".join(WHAT) + "}", parser_class=type(p))
    sub.required = True
    for what, text in WHAT.items():
        s = sub.add_parser(what, help=text, description=text)
        _common(s, what)
        if what in ("gemm", "linear", "mlp"):
            _mlp_shape(s)
        elif what == "kernels":
            _kernel_shape(s)
        elif what == "attention":
            _attention_shape(s)
        else:
            _preset_shape(s, vocab=what != "block")
        if what == "optim":
            s.add_argument("--shape", default="", help="one weight OUTxIN (e.g. 4096x11008) instead of a preset")
            s.add_argument("--update", choices=("default", "compiled", "triton", "both"), default="default",
                           help="LowbitAdamW's update: as LOWBIT_TRITON_UPDATE says (default), the compiled passes, "
                                "the Triton kernels (a GPU), or each recipe timed with both in one run")
        if what in ("step", "memory"):
            s.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="blocks",
                           help="with --compile: each block and the head compiled on its own (blocks, the trainer's "
                                "default) or the whole model as one graph (model)")
        if what == "optim":
            s.add_argument("--profile", action="store_true",
                           help="also sum one step's kernel time on a GPU: each Triton pass, the other kernels, and "
                                "the time no kernel ran (launches, a kernel's last wave, waits)")
        if what == "step":
            s.add_argument("--max-batch", type=int, default=0, metavar="N",
                           help="instead: per recipe, the largest micro-batch up to N that fits in memory, and "
                                "tokens/s there (a `capacity` table)")
            s.add_argument("--profile", action="store_true",
                           help="also time forward, backward and optimizer apart and, on a GPU, sum one step's "
                                "kernel time by kind (GEMM, attention, quantization, fused, other) with the GPU's idle "
                                "time")
        if what == "mlp":
            s.add_argument("--no-quantize", action="store_true", help="skip the quantization timing")


def _shape(text: str) -> tuple[int, int] | None:
    if not text:
        return None
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise LowbitError(f"bench: --shape {text!r} is not OUTxIN, e.g. 4096x11008")
    return int(parts[0]), int(parts[1])


def _seqs(text: str) -> list[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise LowbitError(f"bench: --seqs {text!r} is not a list of lengths, e.g. 2048,4096")
    return [int(p) for p in parts]


def _resolve(a: argparse.Namespace, device) -> None:
    """Defaults for the device, and every check of the input, before anything is measured or written."""
    from lowbit.tools.bench.common import BLOCK_SETTINGS, STEP_SETTINGS, lowbit_recipes, torchao_recipes
    from lowbit.tools.bench.layers import preset_args

    gpu = device.type == "cuda"
    if a.what in ("mlp", "kernels"):  # quantization kernels take microseconds: more iterations for a stable median
        a.quantize_steps = a.steps if a.steps is not None else 50 if gpu else DEFAULTS["steps"][1]
    for key, (on_gpu, on_cpu) in DEFAULTS.items():
        if hasattr(a, key) and getattr(a, key) is None:
            setattr(a, key, on_gpu if gpu else on_cpu)
    if getattr(a, "compile", False) is None and a.what != "optim":  # optim: None is the optimizer's own choice
        a.compile = gpu
    if getattr(a, "max_batch", 0) < 0:
        raise LowbitError("bench: --max-batch must be 0 (off) or more")
    for key in ("steps", "tokens", "dim", "hidden", "batch", "seq", "vocab", "heads", "head_dim"):
        if getattr(a, key, 1) < 1:
            raise LowbitError(f"bench: --{key} must be at least 1")
    if getattr(a, "warmup", 0) < 0:
        raise LowbitError("bench: --warmup must be 0 or more")
    if a.what == "optim":
        a.shape = _shape(a.shape)
        from lowbit.optim import update_kernel

        if a.update in ("triton", "both") and not (gpu and update_kernel.available()):
            raise LowbitError(f"bench: --update {a.update} needs a GPU with Triton (LOWBIT_TRITON not 0)")
    if a.what in ("block", "step", "memory", "optim"):  # once, so a bad --preset/--vocab is a user error, not a row per variant
        a.model_args = preset_args(a.preset, a.seq, getattr(a, "vocab", 32000))
    if a.what == "attention":
        a.seq_list = _seqs(a.seqs)
    if a.what not in ("gemm", "kernels", "attention"):
        # what a variant may set
        settings = {"step": STEP_SETTINGS, "optim": ("--optim.",), "block": BLOCK_SETTINGS}.get(a.what, ())
        a.recipe_list = lowbit_recipes(a.recipes, baseline=not a.no_bf16, variants=settings)
        a.torchao_list = torchao_recipes(a.torchao)


def run(a: argparse.Namespace) -> int:
    import torch

    from lowbit.tools.bench.common import Report, metadata, resolve_device

    device = resolve_device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # CUDA events and autocast follow the current device: make it --device
    _resolve(a, device)
    torch.manual_seed(0)
    argv = getattr(a, "argv", None) or sys.argv[1:]
    config = {k: v for k, v in vars(a).items() if k not in ("recipe_list", "torchao_list", "model_args", "argv",
                                                             "seq_list")}
    report = Report(a.what, metadata(device, argv), config, a.out)
    if a.what == "gemm":
        from lowbit.tools.bench.kernels import run_gemm as fn
    elif a.what == "kernels":
        from lowbit.tools.bench.kernels import run_kernels as fn
    elif a.what in ("linear", "mlp", "block"):
        from lowbit.tools.bench import layers

        fn = getattr(layers, f"run_{a.what}")
    elif a.what == "step" and a.max_batch:
        from lowbit.tools.bench.capacity import run_capacity as fn
    elif a.what == "step":
        from lowbit.tools.bench.step import run_step as fn
    elif a.what == "optim":
        from lowbit.tools.bench.optim import run_optim as fn
    elif a.what == "attention":
        from lowbit.tools.bench.attention import run_attention as fn
    else:
        from lowbit.tools.bench.memory import run_memory as fn
    fn(a, device, report)
    report.finish()
    return 0
