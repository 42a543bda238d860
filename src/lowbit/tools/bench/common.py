"""What every `lowbit bench` measurement shares: the device, the metadata printed with each table, the timer, the
variants (bf16, lowbit recipes, torchao float8 recipes) of a module, and the table/JSON output."""

from __future__ import annotations

import copy
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from lowbit.errors import LowbitError

# HBM bandwidth (bytes/s) for the memory floor of a pass over a tensor; matched against the device name.
GPU_HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "B200": 8e12, "A100": 2.0e12}


def resolve_device(name: str) -> torch.device:
    """The trainer's resolve_device (auto, cpu, cuda, cuda:N), its messages naming bench's option."""
    from lowbit.train.trainer import resolve_device as resolve

    try:
        device = resolve(name)
    except LowbitError as e:
        raise LowbitError(str(e).replace("run.device: ", "bench: --device ", 1)) from None
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index (torch 2.11)
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    # the vector ISA torch dispatches to: CPU timings of the same code differ by several times between AVX2 and
    # AVX-512 hosts (inductor's FP8 conversions, for one)
    isa = torch.backends.cpu.get_cpu_capability()
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {isa})"


def torchao_module():
    """torchao if it imports, else None."""
    try:
        import torchao  # noqa: F401
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except Exception:  # ImportError, or a torchao built for another torch
        return None
    return torchao


def command_line(argv: list[str]) -> str:
    """The command line that ran (sys.argv, `python -m lowbit` spelled out), or `lowbit ARGV` when the CLI was
    called from Python with other arguments."""
    if list(sys.argv[1:]) != list(argv):
        return shlex.join(["lowbit", *argv])
    full = list(sys.argv)
    if full[0].endswith(os.path.join("lowbit", "__main__.py")):
        full = [Path(sys.executable).name, "-m", "lowbit"] + full[1:]
    return shlex.join(full)


def metadata(device: torch.device, argv: list[str]) -> dict:
    meta = {"device": device_name(device), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(argv)}
    ao = torchao_module()
    meta["torchao"] = getattr(ao, "__version__", "unknown") if ao else None
    if device.type == "cuda":
        from lowbit.numerics import kernels
        from lowbit.optim import update_kernel

        meta["cuda"] = torch.version.cuda
        meta["lowbit_triton"] = kernels.usable(torch.zeros(1, device=device))  # whether eager casts run Triton
        meta["triton_update"] = update_kernel.ENABLED  # whether LowbitAdamW's update runs its Triton kernels
    return meta


def meta_line(meta: dict) -> str:
    ao = f" | torchao {meta['torchao']}" if meta.get("torchao") else ""
    upd = " | Triton optimizer update" if meta.get("triton_update") else ""
    return f"{meta['device']} | torch {meta['torch']}{ao}{upd} | {meta['date']} | `{meta['command']}`"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _elapsed_ms(fn, device: torch.device, calls: int) -> float:
    """Milliseconds for `calls` calls of fn() launched in a row: CUDA events on a GPU, a wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end)


def time_ms(fn, device: torch.device, iters: int, warmup: int) -> dict:
    """Median (and min, and every iteration's: a spread or a slow step every N shows) milliseconds of fn(), each
    call timed alone."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = [_elapsed_ms(fn, device, 1) for _ in range(iters)]
    return {"ms": statistics.median(times), "ms_min": min(times), "iters": iters,
            "ms_each": [round(t, 5) for t in times]}


def back_to_back_ms(fn, device: torch.device, iters: int) -> float:
    """Milliseconds per call of `iters` calls launched back to back between one pair of events: while the host
    launches faster than the GPU runs, the queue stays full and this is the kernels' time, as inside a step. A
    call timed alone (time_ms) waits for its own launch (guards, wrapper) on an idle GPU."""
    sync(device)
    return _elapsed_ms(fn, device, iters) / iters


def graph_ms(fn, device: torch.device, calls: int = 20, replays: int = 10) -> float:
    """Milliseconds per call of `calls` calls captured in one CUDA graph, replayed `replays` times: the kernels'
    own time with no host launch between them (back_to_back_ms's, unless the host launches slower than they run)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture asks
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    sync(device)
    ms = _elapsed_ms(graph.replay, device, replays) / (calls * replays)
    del graph
    return ms


def error_row(e: BaseException) -> dict:
    if isinstance(e, torch.OutOfMemoryError):
        return {"error": "out of memory"}
    return {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def maybe_compile(module, compiled: bool):
    return torch.compile(module) if compiled else module


class MLP(nn.Module):
    """LLaMA's SwiGLU MLP (the same layers as lowbit.models.llama.FeedForward, with its shape given directly)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


# ---- variants of a module: bf16 (as built), each lowbit recipe, each torchao float8 recipe --------------------------

# what a `bench step` variant may set: how the step computes, not what (the preset's shape stays)
STEP_SETTINGS = ("--optim.", "--numerics.", "--model.checkpointing=", "--model.sdpa_backend=")
BLOCK_SETTINGS = ("--numerics.fused_producers=",)  # what a `bench block` variant may set


def lowbit_recipes(names: str, baseline: bool = True, variants: tuple[str, ...] = ()) -> list[str]:
    """The lowbit recipes asked for, bf16 first (every ratio is to it) unless `baseline` is off; unknown names are
    a user error. `variants`: the settings an entry RECIPE+section.key=value (as in `lowbit compare`) may set, the
    trainer's config with those (`bench step`: STEP_SETTINGS; `bench optim`: optim.*; `bench block`:
    BLOCK_SETTINGS); none: no variants."""
    from lowbit.tools.compare import split_entry
    from lowbit.train.plan import load_config

    out = [n.strip() for n in names.split(",") if n.strip()]
    for n in out:
        base, overrides = split_entry(n)
        if overrides and not variants:
            raise LowbitError(f"bench: --recipes: {n!r}: a variant (RECIPE+section.key=value) is for `bench step`, "
                              "`bench optim` and `bench block`")
        if any(not o.startswith(variants) for o in overrides):  # the only settings the bench takes from a config
            keys = [k.strip("-=") + ("* keys" if k.endswith(".") else "") for k in variants]
            keys = ", ".join(keys[:-1]) + " and " + keys[-1] if len(keys) > 1 else keys[0]
            raise LowbitError(f"bench: --recipes: {n!r}: a variant sets only {keys}")
        load_config(None, ["--recipe", base, *overrides])  # a bad recipe or setting fails here, before anything runs
    return (["bf16"] if baseline else []) + [n for n in out if n != "bf16"]


def torchao_recipes(names: str) -> list[str]:
    out = [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]
    for n in out:
        if n not in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
            raise LowbitError(f"bench: --torchao {n!r} is not one of tensorwise, rowwise, rowwise_with_gw_hp, none")
    if out and torchao_module() is None:
        print("torchao is not installed (or does not import with this torch): its rows are omitted", flush=True)
        return []
    return out


def torchao_convert(module: nn.Module, recipe: str, skip: tuple[str, ...] = ("output",)) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(module, config=Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=lambda m, fqn: fqn.split(".")[-1] not in skip)


@dataclass(frozen=True)
class Variant:
    name: str  # as printed: bf16 | lowbit <recipe> | torchao <recipe>
    impl: str  # bf16 | lowbit | torchao
    recipe: str


def variants(recipes: list[str], ao_recipes: list[str]) -> list[Variant]:
    out = [Variant("bf16", "bf16", "bf16")] if "bf16" in recipes else []
    out += [Variant(f"lowbit {r}", "lowbit", r) for r in recipes if r != "bf16"]
    out += [Variant(f"torchao {r}", "torchao", r) for r in ao_recipes]
    return out


def apply_variant(base: nn.Module, v: Variant) -> nn.Module:
    """A deep copy of `base` converted as `v` says (the base itself stays plain)."""
    from lowbit.numerics.recipes import convert, get_recipe

    m = copy.deepcopy(base)
    if v.impl == "lowbit":
        from lowbit.tools.compare import split_entry
        from lowbit.train.plan import load_config

        recipe, overrides = split_entry(v.recipe)
        convert(m, get_recipe(recipe))
        # `bench block`'s one variant (BLOCK_SETTINGS), its value read as the trainer reads it
        if overrides and load_config(None, ["--recipe", recipe, *overrides]).numerics.fused_producers:
            from lowbit.numerics.fused_producers import install_fused_producers

            install_fused_producers(m)
    elif v.impl == "torchao":
        m = torchao_convert(m, v.recipe)
    return m


def add_ratios(rows: list[dict], key: str = "ms", base: str = "bf16", out: str = "speedup_vs_bf16") -> None:
    """row[out] = base row's key / row's key (a speed-up for times)."""
    ref = next((r for r in rows if r.get("variant") == base and key in r), None)
    for r in rows:
        if ref and key in r and r[key]:
            r[out] = ref[key] / r[key]


# ---- output ----------------------------------------------------------------------------------------------------------

@dataclass
class Table:
    name: str  # JSON key
    title: str
    columns: list[tuple[str, str, str]]  # (row key, header, format spec)
    rows: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def markdown(self) -> str:
        lines = [f"| {self.title} | " + " | ".join(h for _, h, _ in self.columns[1:]) + " |",
                 "|" + "---|" * len(self.columns)]
        for r in self.rows:
            first = str(r.get(self.columns[0][0], ""))
            if "error" in r:
                lines.append(f"| {first} | {r['error']} |" + " |" * (len(self.columns) - 2))
                continue
            cells = []
            for key, _, fmt in self.columns[1:]:
                v = r.get(key)
                cells.append("" if v is None else format(v, fmt) if fmt else str(v))
            lines.append(f"| {first} | " + " | ".join(cells) + " |")
        return "\n".join(lines + [""] + self.notes)


class Report:
    """The tables of one `lowbit bench` run; the JSON file is written when the run starts and rewritten after every
    row, so a run cut short by a time limit still leaves what it measured (with "complete": false)."""

    def __init__(self, what: str, meta: dict, config: dict, out: str):
        self.what, self.meta, self.config, self.out = what, meta, config, out
        self.tables: list[Table] = []
        try:  # valid JSON (metadata, no rows yet) at once: an unwritable --out fails before the measuring
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
            self.save(complete=False)
        except OSError as e:
            raise LowbitError(f"bench: --out {out}: cannot write ({e.strerror})") from None

    def table(self, t: Table) -> Table:
        self.tables.append(t)
        return t

    def row(self, t: Table, row: dict) -> None:
        t.rows.append(row)
        print(json.dumps({t.name: row}), flush=True)
        self.save(complete=False)

    def save(self, complete: bool) -> None:
        if not self.out:
            return
        doc = {"meta": self.meta, "what": self.what, "config": self.config, "complete": complete,
               "tables": {t.name: {"title": t.title, "columns": t.columns, "rows": t.rows, "notes": t.notes}
                          for t in self.tables}}
        tmp = Path(self.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, self.out)

    def finish(self) -> None:
        for t in self.tables:
            print(f"\n{meta_line(self.meta)}\n")
            print(t.markdown())
        self.save(complete=True)
        if self.out:
            from lowbit.tools.bench.plot import plot

            png = Path(self.out).with_suffix(".png")
            try:  # the JSON is written: a drawing that fails costs the picture, not the run
                png = None if png == Path(self.out) else plot(json.loads(Path(self.out).read_text()), png)
            except Exception as e:
                print(f"bench: no plot ({type(e).__name__}: {e})", file=sys.stderr)
                png = None
            print(f"\nwrote {self.out}" + (f" and {png}" if png else ""))
