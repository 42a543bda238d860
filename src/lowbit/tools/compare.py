"""`lowbit compare --recipes a,b,... --out DIR [CONFIG.toml] [--section.key=value ...]`: the same model, data and
seed trained under each recipe (run dir DIR/<recipe>: one after another in this process, or with --devices
concurrently, one `lowbit train` process per run on the next free device), then an overlay of the
training and validation losses (compare.png), a table of final losses with the gap to bf16, throughput, the
worst under/overflowing operand of each low-precision run and the stuck entries of its scaled optimizer moments
(compare.md, compare.json, and printed).

A --recipes entry may be a variant, `RECIPE+section.key=value[+...]`: the recipe with these overrides on top of
the common ones; the entry as given names its run dir and its row.

--seeds 0,1,2 trains every entry once per seed (run dir OUT/<entry>+train.seed=S). A seed sets both the
initialisation and the data order, so each run's gap is taken to bf16 of the same seed (same weights at step 0,
same batches), and a second table gives each entry's mean gap over the seeds with its range, beside bf16's own
spread across seeds: what a gap has to exceed to mean something.

Re-running picks up where it stopped: a finished run is skipped, an unfinished one resumes from its newest good
checkpoint, or starts again if it has none. A run dir trained under another config is an error, not reused
(train.stop_at may differ: it says how far to go, not what to train).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lowbit.errors import LowbitError

LAST_N = 10  # default --last-n: the final training loss is a mean over the last steps, one batch's loss is noisy
# Keys that may differ between the config a run was started with and the one that continues it.
CONTINUATION_KEYS = ("run.resume", "train.stop_at", "run.dir", "optim.cuda_graphs")  # how, not what, it trains
SIGNALS = (signal.SIGINT, signal.SIGTERM)
# A variant's `+` that starts a `section.key=` override; any other `+` (a value such as 1e+3) stays.
VARIANT_SPLIT = re.compile(r"\+(?=[a-z_]+\.[a-z_0-9]+=)")
MOMENTS = {"exp_avg": "m", "exp_avg_sq": "v"}  # short names in the table
SAY = {"train": "training in", "skip": "skipped, finished run in", "resume": "resuming", "restart":
       "restarting (stopped before its first checkpoint)"}


def add_args(p: argparse.ArgumentParser) -> None:
    p.allow_abbrev = False  # `--recipe` is a train key, not an abbreviation of --recipes
    p.description = "Any other argument is lowbit train's: an optional CONFIG.toml and --section.key=value " \
                    "overrides (`lowbit train --help`), the same for every recipe."
    p.add_argument("--recipes", required=True, help="comma-separated recipes (`lowbit recipes`), each one "
                                                    "optionally a variant RECIPE+section.key=value[+...] (those "
                                                    "overrides on top of the common ones, run dir OUT/<entry>); "
                                                    "include bf16 for the gap column, else the gap is to the first")
    p.add_argument("--seeds", default="", help="comma-separated seeds: each entry trained once per seed (run dir "
                                               "OUT/<entry>+train.seed=S), gaps to bf16 of the same seed, and a "
                                               "summary over the seeds beside bf16's own spread")
    p.add_argument("--out", default="runs/compare", help="directory of the runs (OUT/<recipe>) and the report")
    p.add_argument("--devices", default="", help="train the recipes concurrently, each in its own `lowbit train` "
                                                 "process (output in OUT/<recipe>.log) on the next free device of "
                                                 "this list, e.g. cuda:0,cuda:1 (a device named twice takes two "
                                                 "runs at once); empty: one after another in this process")
    p.add_argument("--last-n", type=int, default=LAST_N, help="the final training loss is the mean over the last "
                                                              "N steps (default %(default)s); within one epoch "
                                                              "each is a loss on unseen text, so a longer window "
                                                              "is a larger held-out sample than one validation")


def parse_devices(text: str) -> list[str]:
    import re

    devices = [d.strip() for d in text.split(",")] if text.strip() else []
    for d in devices:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", d):
            raise LowbitError(f"compare: --devices: {d!r} is not cpu, cuda or cuda:N")
    if len({d.split(":")[0] for d in devices}) > 1:  # train.dtype auto would differ: fp32 on cpu, bf16 on cuda
        raise LowbitError(f"compare: --devices: {text!r} mixes cpu and cuda; the runs would train in other dtypes")
    _check_gpus(devices)
    return devices


def _check_gpus(devices: list[str]) -> None:
    """Every cuda device named exists here: refused before any run is launched."""
    import torch

    wanted = [d for d in devices if d.startswith("cuda")]
    have = torch.cuda.device_count() if wanted else 0
    for d in wanted:
        index = int(d.split(":")[1]) if ":" in d else 0
        if index >= have:
            raise LowbitError(f"compare: --devices: {d} is not here ({have} CUDA device(s) visible"
                              f"{'' if have else ': no GPU, or a CPU build of torch'}); use cpu or an index below "
                              f"{max(have, 1)}")


def split_entry(entry: str) -> tuple[str, list[str]]:
    """A --recipes entry: its recipe, and its variant's overrides as `--section.key=value` arguments."""
    base, *overrides = VARIANT_SPLIT.split(entry)
    return base, [f"--{o}" for o in overrides]


def parse_recipes(text: str) -> dict[str, tuple[str, list[str]]]:
    """Each entry as given (its run's name and dir): its recipe and its variant's overrides."""
    from lowbit.numerics.recipes import RECIPES

    names = [n.strip() for n in text.split(",")]
    entries = {}
    for n in names:
        base, overrides = split_entry(n)
        if base not in RECIPES:
            raise LowbitError(f"compare: --recipes: {base!r} is not one of {', '.join(RECIPES)}"
                              + (" (a variant is RECIPE+section.key=value)" if "+" in n else ""))
        if "/" in n or n.startswith("."):  # the entry names its run dir OUT/<entry>
            raise LowbitError(f"compare: --recipes: {n!r} is no directory name (it contains / or starts with .)")
        entries[n] = (base, overrides)
    if len(entries) != len(names):
        raise LowbitError(f"compare: --recipes: {text!r} names a recipe twice")
    return entries


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()] if text.strip() else []
    except ValueError:
        raise LowbitError(f"compare: --seeds: {text!r} is not a comma-separated list of integers") from None
    if len(set(seeds)) != len(seeds):
        raise LowbitError(f"compare: --seeds: {text!r} names a seed twice")
    return seeds


def with_seeds(entries: dict, seeds: list[int], train_args: list[str]) -> dict:
    """Every entry once per seed, named ENTRY+train.seed=S; {name: (recipe, overrides, entry, seed)}."""
    from lowbit.train.config import parse_overrides

    if not seeds:
        return {n: (base, over, n, None) for n, (base, over) in entries.items()}
    if any(key == "train.seed" for key, _ in parse_overrides([a for a in train_args if a.startswith("--")])):
        raise LowbitError("compare: --train.seed and --seeds both set the seed; give one")
    for name, (_, over) in entries.items():
        if any(key == "train.seed" for key, _ in parse_overrides(list(over))):
            raise LowbitError(f"compare: --recipes {name!r} sets train.seed, and so does --seeds; give one")
    return {f"{n}+train.seed={s}": (base, [*over, f"--train.seed={s}"], n, s)
            for s in seeds for n, (base, over) in entries.items()}


def seed_summary(report: dict) -> list[dict]:
    """Per entry over its seeds: mean and range of the same-seed gaps to the baseline, and the spread of its own
    final losses. Only finished runs count (a gap also needs its baseline run finished): `runs` says how many."""
    rows = []
    for entry in dict.fromkeys(r["entry"] for r in report["runs"]):
        runs = [r for r in report["runs"] if r["entry"] == entry]
        done = [r for r in runs if r["finished"]]
        paired = [r for r in done if r["base_finished"]]
        row = {"entry": entry, "seeds": [r["seed"] for r in runs], "runs": len(paired),
               "unfinished": [r["seed"] for r in runs if not r["finished"]]}
        for key, group in (("train_gap_pct", paired), ("val_gap_pct", paired), ("train_loss", done),
                           ("val_loss", done)):
            vals = [r[key] for r in group if r[key] is not None]
            row[key] = {"mean": statistics.fmean(vals), "min": min(vals), "max": max(vals)} if vals else None
        for key in ("train_loss", "val_loss"):  # spread across seeds, in % of the mean
            v = row[key]
            row[f"{key}_spread_pct"] = 100.0 * (v["max"] - v["min"]) / v["mean"] if v and v["mean"] else None
        rows.append(row)
    return rows


def seed_table(report: dict) -> str:
    base = report["baseline"]

    def span(v, entry):
        if entry == base or v is None:
            return "—"
        return f"{v['mean']:+.2f}% ({v['min']:+.2f}% to {v['max']:+.2f}%)"

    lines = [f"Over seeds {', '.join(map(str, report['seeds']))}: each run's gap is to {base} of the same seed; mean "
             f"(min to max) over the finished pairs (runs). Spread: (max - min) / mean of the entry's own final "
             f"losses across its finished seeds.", "",
             f"| entry | runs | train gap to {base} | val gap to {base} | train loss spread | val loss spread |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in report["seed_summary"]:
        unfinished = f" (unfinished: seed {', '.join(map(str, r['unfinished']))})" if r["unfinished"] else ""
        lines.append(f"| {r['entry']}{unfinished} | {r['runs']} | {span(r['train_gap_pct'], r['entry'])} "
                     f"| {span(r['val_gap_pct'], r['entry'])} | {_fmt(r['train_loss_spread_pct'], '.2f', '%')} "
                     f"| {_fmt(r['val_loss_spread_pct'], '.2f', '%')} |")
    return "\n".join(lines)


def _check_keys(overrides: list[str], devices: list[str], where: str) -> None:
    from lowbit.train.config import parse_overrides

    for key, _ in parse_overrides(list(overrides)):
        if key in ("recipe", "run.dir", "run.resume"):
            raise LowbitError(f"compare: {where}--{key} is set by compare for each run (--recipes, --out)")
        if key == "run.device" and devices:
            raise LowbitError(f"compare: {where}--run.device and --devices both say where to train; give one")


def configs(entries: dict, train_args: list[str], out: Path, devices: list[str] = ()) -> dict:
    """The config of each run: the user's, its variant's overrides on top, with the recipe and run dir set; all
    validated before any training."""
    from lowbit.train.plan import load_config

    path, overrides = (train_args[0], train_args[1:]) if train_args and not train_args[0].startswith("--") \
        else (None, train_args)
    _check_keys(overrides, devices, "")
    cfgs = {}
    for name, (base, variant) in entries.items():
        fixed = [f"--recipe={base}", f"--run.dir={out / name}"]
        where = f"--recipes {name!r}: "
        _check_keys(variant, devices, where)
        try:
            cfgs[name] = load_config(path, [*overrides, *variant, *fixed])
        except LowbitError as e:
            if not variant:
                raise
            load_config(path, [*overrides, *fixed])  # an error of the common arguments is not the variant's
            raise LowbitError(f"compare: {where}{e}") from None
    return cfgs


def _flat_config(text: str) -> dict:
    from lowbit.train.config import flatten_table, tomllib

    flat = {k: v for k, v in flatten_table(tomllib.loads(text)) if k not in CONTINUATION_KEYS}
    if "run.device" in flat:  # another GPU may resume a run (--devices), not another kind of device (dtype auto)
        flat["run.device"] = _device_kind(flat["run.device"])
    return flat


def _same_config(saved: dict, now: dict) -> bool:
    """A key the saved config lacks (added to lowbit after that run) counts as equal when it has its default."""
    from lowbit.train.config import Config, to_toml

    defaults = _flat_config(to_toml(Config()))
    return saved == {k: v for k, v in now.items() if k in saved or v != defaults.get(k)}


def _device_kind(device: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device.split(":")[0]


def plan(cfg) -> str:
    """What to do with one run dir: 'train', 'skip' (finished), 'resume' (has a checkpoint), 'restart'."""
    from lowbit.train import checkpoint as ckpt
    from lowbit.train.config import to_toml

    run_dir = Path(cfg.run.dir)
    if not (run_dir / "metrics.jsonl").exists() and not ckpt.list_checkpoints(run_dir):
        return "train"
    saved = run_dir / "config.toml"
    if saved.is_file() and not _same_config(_flat_config(saved.read_text()), _flat_config(to_toml(cfg))):
        raise LowbitError(f"compare: {run_dir} was trained with another config than this one (see its "
                          f"config.toml); choose another --out or delete it")
    if reached(cfg) == target(cfg):
        return "skip"
    return "resume" if ckpt.list_checkpoints(run_dir) else "restart"


def target(cfg) -> int:
    return cfg.train.stop_at or cfg.train.steps


def reached(cfg) -> int | None:
    """The step a run dir's training reached (train writes summary.json last, with it), or None."""
    try:
        return json.loads((Path(cfg.run.dir) / "summary.json").read_text()).get("step")
    except (OSError, ValueError, AttributeError):
        return None


def _ready(cfg, action: str) -> None:
    run_dir = Path(cfg.run.dir)
    if action == "restart":  # stopped before its first checkpoint: nothing to keep, and train refuses the dir
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        shutil.rmtree(run_dir / "tensorboard", ignore_errors=True)
    cfg.run.resume = action == "resume"


def run_one(cfg, action: str) -> None:
    from lowbit.train.trainer import train

    _ready(cfg, action)
    train(cfg)
    gc.collect()  # the next run should not share the device with this one's tensors
    import torch

    torch._dynamo.reset()  # another recipe's graphs would count against the recompile limit (--train.compile)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_concurrently(cfgs: dict, actions: dict, devices: list[str], out: Path) -> None:
    """Each run in its own `lowbit train` process on the next free device; SIGTERM/SIGINT reach every run (each
    stops after its step with a checkpoint, so the next compare resumes it)."""
    from lowbit.train.config import to_toml

    out.mkdir(parents=True, exist_ok=True)
    pending = [r for r in cfgs if actions[r] != "skip"]
    free, running, failed, stopped = list(devices), {}, [], []

    def stop(sig, _frame):  # no exception here: this process goes on waiting for every child it started
        stopped.append(sig)
        for proc in running:
            proc.send_signal(sig)

    old = {sig: signal.signal(sig, stop) for sig in SIGNALS}
    try:
        while (pending and not stopped) or running:
            while pending and free and not stopped:
                r, device = pending.pop(0), free.pop(0)
                cfg = cfgs[r]
                cfg.run.device = device
                _ready(cfg, actions[r])
                launch = out / f".{r}.toml"  # the whole config: the child needs no other argument
                launch.write_text(to_toml(cfg))
                with open(out / f"{r}.log", "a") as log:
                    proc = subprocess.Popen([sys.executable, "-m", "lowbit", "train", str(launch)], stdout=log,
                                            stderr=subprocess.STDOUT)
                running[proc] = (r, device, time.monotonic())
                if stopped:  # the signal came while this child was being started: it has not heard it yet
                    proc.send_signal(stopped[-1])
                print(f"lowbit compare: {r}: {SAY[actions[r]]} {cfg.run.dir} on {device} (log {out / r}.log)",
                      flush=True)
            time.sleep(0.5)
            for proc in [p for p in running if p.poll() is not None]:
                r, device, t0 = running.pop(proc)
                free.append(device)
                step = reached(cfgs[r])  # exit 0 also when a signal stopped it early, with a checkpoint
                what = ("FAILED" if proc.returncode else "finished" if step == target(cfgs[r])
                        else f"stopped at step {step} of {target(cfgs[r])}")
                print(f"lowbit compare: {r}: {what} after {time.monotonic() - t0:.0f} s (exit {proc.returncode})",
                      flush=True)
                if proc.returncode:
                    failed.append(r)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for r in cfgs:
            (out / f".{r}.toml").unlink(missing_ok=True)
    if stopped:
        raise LowbitError(f"compare: stopped by a signal ({', '.join(failed) or 'no run'} ended with an error; "
                          f"a run in its training loop stops with a checkpoint): run the same command to go on")
    if failed:
        logs = ", ".join(str(out / f"{r}.log") for r in failed)
        raise LowbitError(f"compare: {', '.join(failed)} failed: see the end of {logs}")


def read_run(run_dir: Path, low_precision: bool, last_n: int = LAST_N) -> dict:
    from lowbit.tools.inspect import load_telemetry, ranked

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    tps = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    last = [v for _, v in train[-last_n:]]
    reached = max((r["step"] for r in records if "loss" in r), default=0)  # a step with a non-finite loss counts
    out = {"run_dir": str(run_dir), "steps": reached, "train": train, "val": val,
           "train_loss": sum(last) / len(last) if last else None, "val_loss": val[-1][1] if val else None,
           "tokens_per_s": statistics.median(tps) if tps else None, "underflow": None, "saturated": None,
           "moments": None, "moments_step": None}
    states = [r for r in records if "optim_states" in r]  # the trainer's scaled moments, at telemetry steps
    if states:
        out["moments"], out["moments_step"] = states[-1]["optim_states"], states[-1]["step"]
    if low_precision:
        try:
            steps, rows = load_telemetry(run_dir)
        except LowbitError:  # numerics.telemetry_every 0
            return out
        for q, key in (("underflow_pct", "underflow"), ("saturated_pct", "saturated")):
            worst = ranked(rows, q)
            if worst:
                # at 0% no operand is worse than another
                out[key] = {"operand": worst[0][0] if worst[0][1] else None, "pct": worst[0][1], "step": steps[-1]}
    return out


def _gap(v, base):
    return None if v is None or not base else 100.0 * (v - base) / base


def _fmt(v, spec: str, unit: str = "") -> str:
    return "—" if v is None else format(v, spec) + unit


def _moments(moments: dict | None) -> str:
    if not moments:
        return "—"
    def cell(m):  # a run from before subnormal_pct has stuck % alone
        sub = f" / {m['subnormal_pct']:.3g}%" if "subnormal_pct" in m else ""
        return f"{m['kind']} {m['stuck_pct']:.3g}%{sub}"
    return ", ".join(f"{MOMENTS.get(k, k)} {cell(m)}" for k, m in moments.items())


def table(report: dict) -> str:
    base = report["baseline"]
    lines = [f"{report['device']} | torch {report['torch']} | {report['date']} | `{report['command']}`", "",
             f"final train loss: mean of the last {report.get('last_n', LAST_N)} steps; "
             f"final val loss: the last validation; "
             f"gaps relative to {base}{' of the same seed' if report.get('seeds') else ''}"
             f"{'' if base == 'bf16' else ' (bf16 is not in --recipes)'}; tokens/s: "
             f"median of the logged windows; worst underflow (% of non-zeros flushed to zero) and saturation "
             f"(% clamped at the format's max): the worst operand at the last telemetry step; moments: each "
             f"Adam moment stored in a scaled format (m exp_avg, v exp_avg_sq), its format and the % of its "
             f"non-zero stored entries that a decay by its beta alone leaves unchanged (under the run's "
             f"rounding) / that are subnormals of the format, at the last telemetry step", "",
             f"| recipe | steps | train loss | val loss | train gap to {base} | val gap to {base} | tokens/s "
             f"| worst underflow | worst saturation | moments (stuck / subnormal % of non-zeros) |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in report["runs"]:
        worst = ["—" if w is None else f"{w['pct']:.3g}% {w['operand'] or ''}".strip()
                 for w in (r["underflow"], r["saturated"])]
        lines.append(f"| {r['recipe']} | {r['steps']} | {_fmt(r['train_loss'], '.4f')} | {_fmt(r['val_loss'], '.4f')} "
                     f"| {_fmt(r['train_gap_pct'], '+.2f', '%')} | {_fmt(r['val_gap_pct'], '+.2f', '%')} "
                     f"| {_fmt(r['tokens_per_s'], '.0f')} | {worst[0]} | {worst[1]} | {_moments(r['moments'])} |")
    earlier = [r["recipe"] for r in report["runs"] if r["action"] == "skip"]
    if earlier:
        lines += ["", f"Trained by an earlier command (skipped now; their tokens/s are from then): "
                      f"{', '.join(earlier)}."]
    return "\n".join(lines)


def plot(report: dict, out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(12, 4.5))
    # with seeds: a colour per entry, a line style per seed
    entries = list(dict.fromkeys(r.get("entry", r["recipe"]) for r in report["runs"]))
    seeds = report.get("seeds") or [None]
    styles = ["-", "--", ":", "-."]
    for r in report["runs"]:
        color = f"C{entries.index(r.get('entry', r['recipe'])) % 10}"
        ls = styles[seeds.index(r.get("seed")) % len(styles)] if r.get("seed") in seeds else "-"
        if r["train"]:
            ax_t.plot(*zip(*r["train"]), lw=0.8, ls=ls, color=color, label=r["recipe"])
        if r["val"]:
            ax_v.plot(*zip(*r["val"]), marker="o", ls=ls, ms=3, label=r["recipe"], color=color)
    for ax, title in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['device']} | torch {report['torch']} | {report['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def _device_name(cfg) -> str:
    import torch

    from lowbit.train.trainer import resolve_device

    device = resolve_device(cfg.run.device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


def run(a: argparse.Namespace) -> int:
    import torch

    from lowbit.distributed.mesh import world_size
    from lowbit.numerics.recipes import RECIPES

    if world_size() > 1:
        raise LowbitError("compare: runs its recipes one after another in one process; start it without torchrun")
    if a.last_n < 1:
        raise LowbitError(f"compare: --last-n {a.last_n}: give a number of steps >= 1")
    entries = parse_recipes(a.recipes)
    runs_of = with_seeds(entries, parse_seeds(a.seeds), a.train)  # name -> (recipe, overrides, entry, seed)
    recipes = list(runs_of)
    devices = parse_devices(a.devices)
    out = Path(a.out)
    cfgs = configs({n: v[:2] for n, v in runs_of.items()}, a.train, out, devices)
    actions = {r: plan(cfg) for r, cfg in cfgs.items()}  # every run dir checked before anything trains
    for r, cfg in cfgs.items():
        if actions[r] == "skip" or not devices:
            print(f"lowbit compare: {r}: {SAY[actions[r]]} {cfg.run.dir}", flush=True)
        if actions[r] != "skip" and not devices:
            run_one(cfg, actions[r])
    if devices:
        run_concurrently(cfgs, actions, devices, out)

    base = "bf16" if "bf16" in entries else next(iter(entries))
    base_of = {r: base if seed is None else f"{base}+train.seed={seed}" for r, (_, _, _, seed) in runs_of.items()}
    runs = {r: read_run(Path(cfgs[r].run.dir), RECIPES[runs_of[r][0]].linear is not None, a.last_n) for r in recipes}
    report = {"device": _device_name(cfgs[base_of[recipes[0]]]), "torch": torch.__version__,
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": a.command, "baseline": base, "last_n": a.last_n, "runs": []}
    for r in recipes:
        run_, ref = runs[r], runs[base_of[r]]
        report["runs"].append({"recipe": r, "entry": runs_of[r][2], "seed": runs_of[r][3],
                               "finished": run_["steps"] >= target(cfgs[r]),
                               "base_finished": ref["steps"] >= target(cfgs[base_of[r]]),
                               "action": actions[r], **run_,
                               "train_gap_pct": _gap(run_["train_loss"], ref["train_loss"]),
                               "val_gap_pct": _gap(run_["val_loss"], ref["val_loss"])})
    if runs_of[recipes[0]][3] is not None:
        report["seeds"] = list(dict.fromkeys(seed for *_, seed in runs_of.values()))
        report["seed_summary"] = seed_summary(report)
    out.mkdir(parents=True, exist_ok=True)
    text = table(report) + ("\n\n" + seed_table(report) if "seeds" in report else "")
    (out / "compare.md").write_text(text + "\n")
    (out / "compare.json").write_text(json.dumps(report, indent=1))
    plot(report, out / "compare.png")
    print(text)
    print(f"lowbit compare: wrote {out / 'compare.md'}, {out / 'compare.json'}, {out / 'compare.png'}")
    return 0
