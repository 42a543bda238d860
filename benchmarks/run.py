"""Rerun the GPU benchmarks behind BENCHMARKS.md and rewrite its tables: the one entry point.

    python benchmarks/run.py --list                     # every step: name, GPUs, the result files it writes
    python benchmarks/run.py --dry-run [--only A,B]     # the commands, nothing run
    python benchmarks/run.py [--only A,B] [--out DIR]   # run them, then rewrite BENCHMARKS.md (benchmarks/report.py)

A step is a name, the shell commands it runs and the result files they write, named by what they measure and the
device (`step_7b_h200.json`, `{dev}` below: `h200`, `h100`, `cpu`...). Every table in BENCHMARKS.md is rendered
from one of these files by benchmarks/report.py, which names the step that rewrites it; tests/test_docs.py checks
that every table has a step. With the default --out (benchmarks/results/) a run also points BENCHMARKS.md's markers
at the files it wrote (a run on an H100 replaces the H200 files' tables), stamps each file with the commit it
measured, and calls report.py. Text outside the tables (the analysis) is not rewritten: read the new numbers.

Without --only, the suite runs every one-GPU and CPU step in the order below. Multi-GPU steps (`gpus` 2) are not
part of it: they run only when --only names them, on a host with 2 GPUs. `grad-sync` writes its table; the
`multi-gpu-*` steps run multi_gpu.sh's parts, keep their run records (JSON lines) and compute their tables from them
(`multi_gpu_report.py tables`). The `goals` step, a summary edited by hand, runs nothing: the one table by hand.

Why a table of steps in Python rather than shell scripts: the test reads it (every table has a step), the report
reads it (each table names its rerun command), and --list/--dry-run cost nothing on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEV = "{dev}"


@dataclass(frozen=True)
class Step:
    name: str
    what: str  # the tables it feeds, in words
    commands: tuple[str, ...]  # shell, from the repository root; {out} the output folder, {dev} the device tag
    outputs: tuple[str, ...]  # result files its commands write into {out} ("FILE#KEY": only that table of FILE)
    gpus: int = 1  # 0: CPU only; 2: a multi-GPU step, not run by the suite
    by_hand: str = ""  # why its table JSON is not written by its commands


def bench(args: str, out: str) -> str:
    return f"python3 -m lowbit bench {args} --out {{out}}/{out}"


S1B = "step --steps 20 --warmup 3 --compile-scope blocks"
TRAIN_13B = ("python3 -m lowbit train --model.preset 13b --recipe fp8lm-o2 --data.seq_len 2048 --train.batch_size 8 "
             "--train.micro_batch_size 4 --train.steps 50 --train.warmup_steps 10 --train.lr 3e-4 --train.compile true "
             "--train.log_every 5 --train.eval_every 0 --train.eval_batches 1 --numerics.telemetry_every 0 "
             "--checkpoint.save false --run.plot false --run.dir /tmp/lowbit_run_13b > {out}/train_13b_{dev}.txt 2>&1; "
             "python3 benchmarks/run.py --train-table /tmp/lowbit_run_13b --out {out}/train_13b_{dev}.json")


def multi_gpu(parts: str, tables: str) -> tuple[str, ...]:
    """multi_gpu.sh's parts into one scratch folder, their run records and env.txt copied into {out}, then the
    tables computed from them (multi_gpu_report.py tables). Part a/b/c's one-GPU runs are the references of d and
    e: their earlier files are read where this run did not write them (a missing file is skipped)."""
    tmp, raw = f"/tmp/lowbit_multi_gpu_{parts}", "{out}/multi_gpu_{dev}"
    refs = f"{raw}_runs.json {raw}_abc.jsonl " if parts != "abc" else ""
    return (f"rm -rf {tmp}", *(f"OUT={tmp} bash benchmarks/multi_gpu.sh {p}" for p in parts),
            f"cp {tmp}/results.jsonl {raw}_{parts}.jsonl && cp {tmp}/env.txt {raw}_{parts}_env.txt",
            f"python3 benchmarks/multi_gpu_report.py tables --only {tables} --env {raw}_{parts}_env.txt "
            f"--out {raw}_tables.json {refs}{raw}_{parts}.jsonl")


STEPS: tuple[Step, ...] = (
    Step("goals", "where the goals stand", (), ("goals.json",), 0,
         by_hand="a summary of the other tables' numbers, edited by hand after a run"),
    Step("optim-7b", "the 7b optimizer step alone, compiled passes beside the Triton kernels, with bounded scales",
         (bench("optim --preset 7b --steps 10 --warmup 3 --update both --recipes fp8lm-o2,fp8lm-o3,fp4,"
                "fp8lm-o2+optim.scales=bound,fp8lm-o3+optim.scales=bound,fp4+optim.scales=bound",
                "optim_7b_{dev}.json"),), ("optim_7b_{dev}.json",)),
    Step("optim-7b-triton", "the 7b optimizer step alone, the Triton kernels as shipped, two passes, bounded and "
         "mixed scales, beside fp32 AdamW, with each pass's kernel time",
         (bench("optim --preset 7b --steps 10 --warmup 3 --update triton --profile --recipes fp8lm-o2,fp8lm-o3,fp4,"
                "fp8lm-o2+optim.scales=bound,fp8lm-o2+optim.scales=mixed,fp8lm-o3+optim.scales=mixed",
                "optim_7b_triton_{dev}.json"),), ("optim_7b_triton_{dev}.json",)),
    Step("optim-sweep-7b", "the Triton update's launch shapes and approximate math on the 7b parameters",
         ("git show f58d11e:src/lowbit/optim/update_kernel.py > /tmp/update_kernel_f58d11e.py && "
          "python3 benchmarks/optim_kernel_sweep.py --preset 7b --baseline /tmp/update_kernel_f58d11e.py "
          "--out {out}/optim_kernel_sweep_7b_{dev}.json",),
         ("optim_kernel_sweep_7b_{dev}.json",)),
    Step("step-7b", "the 7b training step, 4 x 2048, beside bf16 and torchao",
         (bench("step --preset 7b --batch 4 --seq 2048 --steps 5 --warmup 2 --recipes bf16,fp8-tensorwise,fp8lm-o2,"
                "fp8lm-o2+optim.scales=bound --torchao tensorwise", "step_7b_{dev}.json"),), ("step_7b_{dev}.json",)),
    Step("fused-7b", "the 7b training step, 4 x 2048, with the fused FP8 producers, beside bf16 and torchao",
         (bench("step --preset 7b --batch 4 --seq 2048 --steps 5 --warmup 2 --recipes bf16,fp8-tensorwise,"
                "fp8-tensorwise+numerics.fused_producers=true --torchao tensorwise", "step_7b_fused_{dev}.json"),),
         ("step_7b_fused_{dev}.json",)),
    Step("block-7b", "one 7b block, 4 x 2048, fwd+bwd, with and without the fused FP8 producers, beside bf16 and "
         "torchao (fits where the 7b step's bf16 does not)",
         (bench("block --preset 7b --batch 4 --seq 2048 --steps 20 --warmup 5 --recipes bf16,fp8-tensorwise,"
                "fp8-tensorwise+numerics.fused_producers=true --torchao tensorwise", "block_7b_{dev}.json"),),
         ("block_7b_{dev}.json",)),
    Step("build-7b", "building the 7b model (the build s column)",
         (bench("step --preset 7b --batch 4 --seq 2048 --steps 5 --warmup 2 --recipes fp8-tensorwise,fp8lm-o2 "
                "--no-bf16 --torchao none", "step_7b_build_{dev}.json"),), ("step_7b_build_{dev}.json",)),
    Step("capacity-7b", "the largest 7b micro-batch per recipe and its speed",
         (bench("step --preset 7b --seq 2048 --max-batch 32 --steps 3 --warmup 1 --recipes bf16,fp8lm-o2 "
                "--torchao tensorwise", "capacity_7b_{dev}.json"),), ("capacity_7b_{dev}.json",)),
    Step("train-13b", "13b trained under fp8lm-o2 for 50 steps", (TRAIN_13B,), ("train_13b_{dev}.json",)),
    Step("step-1b", "the 1b step: bf16, fp8-tensorwise (fast and precise forward accumulation), fp8lm-o2, torchao, "
         "alone and in a row",
         (bench(f"{S1B} --recipes bf16,fp8-tensorwise,fp8-tensorwise+numerics.fprop_accum=precise,fp8lm-o2 "
                "--torchao tensorwise", "step_1b_torchao_{dev}.json"),),
         ("step_1b_torchao_{dev}.json",)),
    Step("profile-1b", "where the 1b step's time goes (fp8-tensorwise with and without the fused FP8 producers, "
         "fp8-delayed, torchao)",
         (bench(f"{S1B} --recipes bf16,fp8-tensorwise,fp8-tensorwise+numerics.fused_producers=true,fp8-delayed "
                "--torchao tensorwise --profile",
                "step_1b_profile_{dev}.json"),), ("step_1b_profile_{dev}.json",)),
    Step("fused-1b", "the 1b step with and without the fused FP8 producers, current and delayed, beside bf16",
         (bench("step --steps 10 --warmup 2 --compile-scope blocks --torchao none --profile "
                "--recipes bf16,fp8-tensorwise,fp8-tensorwise+numerics.fused_producers=true,fp8-delayed,"
                "fp8-delayed+numerics.fused_producers=true",
                "step_1b_fused_{dev}.json"),),
         ("step_1b_fused_{dev}.json",)),
    Step("producers-1b", "the fused FP8 producers' host and GPU time per call at the 1b shapes",
         ("python3 benchmarks/producer_launch.py --out {out}/producer_launch_{dev}.json",),
         ("producer_launch_{dev}.json",)),
    Step("recipes-1b", "the 1b step of fp8lm-o2, nanotron-r2 and fp4 beside fp8-tensorwise",
         ("TORCH_LOGS=recompiles " + bench(f"{S1B} --no-bf16 --torchao none --profile "
                                           "--recipes fp8-tensorwise,fp8lm-o2,nanotron-r2,fp4",
                                           "step_1b_recipes_{dev}.json"),), ("step_1b_recipes_{dev}.json",)),
    Step("fp4-1b", "the 1b step under fp4 with OCC's compensation products in bf16 and in FP8, beside fp8-tensorwise",
         (bench("step --steps 10 --warmup 2 --compile-scope blocks --no-bf16 --torchao none --profile "
                "--recipes fp8-tensorwise,fp4,fp4+numerics.occ_products=fp8", "step_1b_fp4_{dev}.json"),),
         ("step_1b_fp4_{dev}.json",)),
    Step("graphs-1b", "fp8lm-o2 and nanotron-r2 with and without the optimizer's CUDA graphs",
         (bench(f"{S1B} --no-bf16 --torchao none --profile --recipes fp8lm-o2+optim.cuda_graphs=false,fp8lm-o2,"
                "fp8-tensorwise,nanotron-r2+optim.cuda_graphs=false,nanotron-r2", "step_1b_cuda_graphs_{dev}.json"),),
         ("step_1b_cuda_graphs_{dev}.json",)),
    Step("hf-1b", "the 1b step beside HF transformers' LlamaForCausalLM",
         ("python3 benchmarks/step_1b.py --steps 10 --out {out}/step_1b_hf_{dev}.json",), ("step_1b_hf_{dev}.json",)),
    Step("mlp-7b", "the 7B MLP compiled and eager, and the quantization kernel",
         (bench("mlp --recipes bf16,fp8-tensorwise --torchao tensorwise", "mlp_7b_{dev}.json"),
          bench("mlp --eager --recipes bf16,fp8-tensorwise --torchao tensorwise", "mlp_7b_eager_{dev}.json"),
          # the prose's numbers beside the tables: torch's quantize passes eagerly, the Triton kernels' settings
          "LOWBIT_TRITON=0 " + bench("mlp --eager --recipes fp8-tensorwise --no-bf16 --torchao none",
                                     "mlp_7b_eager_torch_{dev}.json"),
          "python3 benchmarks/quantize_sweep.py --out {out}/quantize_sweep_{dev}.json"),
         ("mlp_7b_{dev}.json", "mlp_7b_eager_{dev}.json")),
    Step("kernels-7b", "the fused cast + transpose and the fused producers against their unfused passes and the "
         "memory floor, and the MLP with the fused tail (7B shapes, 16384 tokens)",
         (bench("kernels", "kernels_7b_{dev}.json"),), ("kernels_7b_{dev}.json",)),
    Step("gemm-7b", "the 7B MLP's GEMMs", (bench("gemm", "gemm_7b_mlp_{dev}.json"),), ("gemm_7b_mlp_{dev}.json",)),
    Step("memory-1b", "activations saved for backward at 1b",
         (bench("memory --eager --recipes bf16,fp8-tensorwise,fp8-tensorwise-coat --torchao tensorwise",
                "memory_1b_{dev}.json"),), ("memory_1b_{dev}.json",)),
    Step("compile-125m", "125m: regional against whole-model compilation, and where its step's time goes",
         tuple(bench(f"step --preset 125m --steps 10 --warmup 2 --recipes fp8-tensorwise --no-bf16 --torchao none "
                     f"--compile-scope {scope}", f"compile_scope_125m_{scope}_{{dev}}.json")
               for scope in ("blocks", "model"))
         + (bench("step --preset 125m --steps 10 --warmup 2 --recipes bf16,fp8-tensorwise --torchao none "
                  "--compile-scope blocks --profile", "step_125m_profile_{dev}.json"),),
         ("compile_scope_125m_blocks_{dev}.json", "compile_scope_125m_model_{dev}.json",
          "step_125m_profile_{dev}.json")),
    Step("occ", "one OCC linear (fp4) beside fp8-tensorwise",
         ("python3 benchmarks/occ_linear.py --device cuda --tokens 16384 --dims 1024,4096 "
          "--recipes fp4,fp4:fp8,fp4:sparse,fp4-no-occ,fp8-tensorwise --out {out}/occ_linear_{dev}.json",),
         ("occ_linear_{dev}.json",)),
    Step("performer", "Performer against SDPA flash attention",
         ("python3 benchmarks/performer.py --chunks 256,1024 --profile 16384 --out {out}/performer_{dev}.json",),
         ("performer_{dev}.json",)),
    Step("attention-fp8", "causal attention: SDPA bf16 flash against numerics.fp8_attention, fwd and fwd+bwd, 2k-16k",
         (bench("attention --seqs 2048,4096,8192,16384 --steps 20 --warmup 5", "attention_fp8_{dev}.json"),),
         ("attention_fp8_{dev}.json",)),
    Step("ring-1gpu", "context parallelism's block schedule on one GPU against one SDPA flash call (32k-128k), and "
         "the 1b model's memory per token with it (what benchmarks/cp_memory.py predicts from)",
         ("python3 benchmarks/ring_attention.py --out {out}/ring_attention_{dev}.json",),
         ("ring_attention_{dev}.json",)),
    Step("optim-cpu", "the update of one 4096x11008 weight on the CPU",
         (bench("optim --device cpu --shape 4096x11008 --steps 5 --torchao none "
                "--recipes fp8lm-o2,fp8lm-o3,nanotron-r2,fp4,fp8lm-o2+optim.weights=bf16,fp8lm-o2+optim.scales=bound",
                "optim_4096x11008_{dev}.json"),), ("optim_4096x11008_{dev}.json",), 0),
    Step("comm-bytes", "bytes on the wire per step by layout (4 gloo processes on the CPU)",
         ("python3 benchmarks/comm_bytes.py --out {out}/comm_bytes_{dev}.json",), ("comm_bytes_{dev}.json",), 0),
    Step("multi-gpu-abc", "two GPUs: tensor/sequence, context and pipeline parallelism, a few hundred steps",
         multi_gpu("abc", "tp_sp,cp,pp,long"),
         tuple(f"multi_gpu_{{dev}}_tables.json#{k}" for k in ("tp_sp", "cp", "pp", "long")), 2),
    Step("multi-gpu-d", "two GPUs: data parallelism and FSDP2 at 1b", multi_gpu("d", "dp_fsdp"),
         ("multi_gpu_{dev}_tables.json#dp_fsdp",), 2),
    Step("multi-gpu-e", "two GPUs: FSDP2 with FP8 weight all-gathers", multi_gpu("e", "fsdp_fp8_gather"),
         ("multi_gpu_{dev}_tables.json#fsdp_fp8_gather",), 2),
    Step("grad-sync", "two GPUs: the gradient exchange alone",
         ("torchrun --nproc-per-node 2 benchmarks/grad_sync_bench.py --out {out}/grad_sync_{dev}.json",),
         ("grad_sync_{dev}.json",), 2),
)


def pattern(output: str) -> re.Pattern:
    """The file names an output template stands for, on any device: {dev} is one word without underscores."""
    return re.compile(re.escape(output.split("#")[0]).replace(re.escape(DEV), "([a-z0-9]+)") + "$")


def step_of(name: str, key: str = "") -> Step | None:
    """The step that writes result file `name` (its table `key`, where a step writes only some of a file's)."""
    for s in STEPS:
        for o in s.outputs:
            file, _, only = o.partition("#")
            if pattern(file).match(name) and (not only or not key or only == key):
                return s
    return None


def rerun_command(s: Step) -> str:
    if s.by_hand and not s.commands:
        return "hand, after a run of the others"
    where = " on 2 GPUs, not part of the one-GPU suite" if s.gpus > 1 else ""
    return f"`python benchmarks/run.py --only {s.name}`{where}"


def device_tag(gpus: int) -> str:
    """`h200`, `h100`, ... from the CUDA device's name (`h200x2` for a 2-GPU step); `cpu` for a CPU step."""
    if gpus == 0:
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("run.py: no CUDA device; --dry-run and --list need none")
    name = torch.cuda.get_device_name().lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4}[a-z]?)\b", name.replace("nvidia", ""))
    tag = m.group(1) if m else re.sub(r"[^a-z0-9]", "", name)[:12]
    return f"{tag}x{gpus}" if gpus > 1 else tag


def commit(given: str) -> str:
    """The commit measured: --commit, else the checkout's HEAD (with "+ local changes" when the tree differs)."""
    if given:
        return given
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return out + (" + local changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "not recorded (no git checkout: pass --commit)"


def stamp(path: Path, measured: str) -> None:
    """Record the commit the run measured in the file's meta (`lowbit bench` does not know it)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    doc.setdefault("meta", {})["commit"] = measured
    path.write_text(json.dumps(doc, indent=1) + "\n")


def repoint(markdown: Path, written: list[str]) -> int:
    """Point BENCHMARKS.md's markers at the files just written where they name the same measurement (on this device
    or another), dropping the commit= / added= words the new file's meta makes stale. Returns the markers changed."""
    text, n = markdown.read_text().split("\n"), 0
    for i, line in enumerate(text):
        m = re.match(r"^<!-- table: results/(\S+) (\S+)((?: \S+)*) -->$", line)
        if not m:
            continue
        for w in written:
            s = step_of(w, m.group(2))
            if s is None or step_of(m.group(1), m.group(2)) is not s:
                continue
            if not any(pattern(o).match(m.group(1)) and pattern(o).match(w) for o in s.outputs):
                continue
            words = [x for x in m.group(3).split() if not x.startswith(("commit=", "added="))]
            new = f"<!-- table: results/{w} {' '.join([m.group(2)] + words)} -->"
            n += new != text[i]
            text[i] = new
    markdown.write_text("\n".join(text))
    return n


def train_table(run_dir: Path, out: Path) -> None:
    """The 13b table from a training run's metrics.jsonl and memory.json: bytes/param, tokens/s, MFU, peak memory,
    the loss every 10 steps and the validation loss."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    mem = json.loads((run_dir / "memory.json").read_text())
    train = [r for r in recs if r.get("tokens_per_s") is not None]
    val = [r for r in recs if r.get("val_loss") is not None]
    late = [r for r in train if r["step"] >= 10] or train
    tps = sorted(r["tokens_per_s"] for r in late)
    losses = [r for r in train if r.get("loss") is not None]
    picked = losses[::2] + ([losses[-1]] if len(losses) % 2 == 0 else [])

    def row(what, value):
        return {"what": what, "value": value}

    rows = [row("bytes/param (memory.json)", f"{mem['covered']['bytes_per_param']['total']:.2f} for the covered "
                f"{mem['covered']['params'] / 1e9:.2f}B, {mem['model']['bytes_per_param']['total']:.2f} for the model"),
            row(f"tokens/s (steps {late[0]['step']}-{late[-1]['step']}: median, range)",
                f"{tps[len(tps) // 2]:,.0f} ({tps[0]:,.0f}-{tps[-1]:,.0f})"),
            row("MFU (last logged step)", f"{100 * late[-1]['mfu']:.1f}%" if late[-1].get("mfu") else "-"),
            row("peak GiB", f"{max(r.get('peak_mem_gib') or 0 for r in train):.1f}"),
            row("training loss at steps " + ", ".join(str(r["step"]) for r in picked),
                ", ".join(f"{r['loss']:.2f}" for r in picked)),
            row("validation loss", f"{val[-1]['val_loss']:.2f}" if val else "-")]
    title = f"{mem['model']['params'] / 1e9:.2f}B parameters"
    doc = {"meta": {"device": _device_name(), "torch": _torch_version(), "date": _now(),
                    "command": "python benchmarks/run.py --only train-13b"},
           "what": "table", "complete": True,
           "tables": {"train": {"title": title, "columns": [["what", title, ""], ["value", "", ""]], "rows": rows,
                                "notes": []}}}
    out.write_text(json.dumps(doc, indent=1) + "\n")


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def chosen(only: str) -> list[Step]:
    if not only:
        return [s for s in STEPS if s.gpus <= 1 and s.commands]
    names = [x.strip() for x in only.split(",") if x.strip()]
    known = {s.name: s for s in STEPS}
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"run.py: unknown step(s) {', '.join(bad)}; --list shows them")
    return [known[n] for n in names]


def commands(s: Step, out: str, dev: str) -> list[str]:
    return [c.replace("{out}", out).replace("{dev}", dev) for c in s.commands]


def list_steps() -> None:
    for s in STEPS:
        gpus = {0: "CPU", 1: "1 GPU"}.get(s.gpus, f"{s.gpus} GPUs, not in the suite")
        note = f" [table JSON by hand: {s.by_hand}]" if s.by_hand else ""
        print(f"{s.name:14s} {gpus:24s} {', '.join(s.outputs)}\n{'':14s} {s.what}{note}")


def wheels() -> list[str]:
    """torchao and other optional packages from wheels in .whl/ when present (a GPU host without an index):
    installed into a folder the commands' PYTHONPATH starts with. bench leaves torchao's rows out without it."""
    found = sorted((ROOT / ".whl").glob("*.whl"))
    if not found:
        return []
    site = Path("/tmp/lowbit_bench_site")
    rc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                         "--target", str(site), *map(str, found)]).returncode
    return [str(site)] if rc == 0 else []


def run_step(s: Step, out: Path, limit_s: int, extra: list[str]) -> list[str]:
    """Run one step's commands (each under `timeout`), their output in OUT/<first result's name>_log.txt; the
    result files it wrote."""
    dev = device_tag(s.gpus)
    log = out / (s.outputs[0].split("#")[0].replace(DEV, dev).removesuffix(".json") + "_log.txt")
    path = extra + [str(ROOT / "src")] + [x for x in [os.environ.get("PYTHONPATH")] if x]
    # `python3` in a command is this interpreter (a virtual environment's, say), not the first one on the PATH
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path),
           "PATH": os.pathsep.join([bindir, os.environ.get("PATH", "")])}
    started = time.time()
    where = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else str(out)
    with log.open("w") as f:
        for c in commands(s, where, dev):
            print(f"== {s.name}: {c}", flush=True)
            rc = subprocess.run(["timeout", str(limit_s), "bash", "-c", c], cwd=ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT).returncode
            print(f"   exit {rc}", flush=True)
    written = [o.split("#")[0].replace(DEV, dev) for o in s.outputs]
    # a file from an earlier run that this one did not rewrite (a failed command) is not this run's result
    return [w for w in dict.fromkeys(written) if (out / w).exists() and (out / w).stat().st_mtime >= started]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the steps and the files they write")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--only", default="", help="comma-separated step names (default: every one-GPU and CPU step)")
    p.add_argument("--out", default="benchmarks/results", help="where the result files go (default benchmarks/results)")
    p.add_argument("--limit-s", type=int, default=900, help="seconds per command before it is stopped")
    p.add_argument("--no-report", action="store_true", help="leave BENCHMARKS.md as it is")
    p.add_argument("--commit", default="", help="the commit measured, where the tree is not a git checkout")
    p.add_argument("--train-table", metavar="RUN_DIR", help=argparse.SUPPRESS)  # the 13b step's second command
    a = p.parse_args(argv)
    if a.train_table:
        train_table(Path(a.train_table), Path(a.out))
        return 0
    if a.list:
        list_steps()
        return 0
    steps = chosen(a.only)
    if a.dry_run:
        for s in steps:
            dev = "cpu" if s.gpus == 0 else "{dev}"
            print(f"# {s.name}: {s.what} -> {', '.join(o.replace(DEV, dev) for o in s.outputs)}")
            for c in commands(s, a.out, dev) or [f"(nothing to run: {s.by_hand})"]:
                print(c)
        return 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    extra = wheels()
    measured, written = commit(a.commit), []
    for s in steps:
        files = run_step(s, out, a.limit_s, extra)
        for w in files:
            stamp(out / w, measured)
        written += files
        print(f"   wrote {', '.join(files) or 'nothing'}", flush=True)
    if a.no_report or out != RESULTS.resolve():
        print(f"run.py: {len(written)} result files in {out}; BENCHMARKS.md not rewritten")
        return 0
    n = repoint(ROOT / "BENCHMARKS.md", written)
    print(f"run.py: {len(written)} result files; {n} markers now name them", flush=True)
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py")], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
