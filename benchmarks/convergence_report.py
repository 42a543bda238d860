"""docs/convergence.md's tables and plot from the study's run dirs (benchmarks/convergence_study.sh's
/tmp/study/runs, or its study.tar.gz unpacked). Uses `lowbit compare`'s own reading, table and plot; adds what compare
cannot: runs cut short, the validation loss of every run at common steps (so a run that stopped early is still
compared at the steps it reached), and the training loss over windows of --window steps. A run of another seed
(`ENTRY+train.seed=S`, as `lowbit compare --seeds` names them) is paired with bf16 of that seed. Writes
OUT/convergence.json and OUT/convergence.png and prints the tables.

  python benchmarks/convergence_report.py RUNS_DIR [--eager EAGER_RUNS_DIR] [--out DIR] [--window STEPS]
      [--command CMD --torch VERSION --date DATE]   (when RUNS_DIR has no compare.json: compare was stopped)
  python benchmarks/convergence_report.py --doc          # rewrite docs/convergence.md's tables
  python benchmarks/convergence_report.py --check-doc    # exit 1 if one is out of date

The doc's tables (`--doc`) are made from the committed results in benchmarks/results/convergence/: each row names
its runs (ROWS and KNOBS below); a cell is a run's gap to bf16 of the same seed over 64 training steps, or at a
validation step.
"""

import argparse
import json
import re
import sys
from pathlib import Path

from lowbit.numerics.recipes import RECIPES
from lowbit.tools.compare import LAST_N, _gap, plot, read_run, split_entry, table

# ---- docs/convergence.md's results table, from the committed results (`--doc`, `--check-doc`) ----
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "convergence"
DOC = ROOT / "docs" / "convergence.md"
DOC_COMMAND = "python benchmarks/convergence_report.py --doc"
T3 = "third_series/"
# One row per recipe as it is named now: (label, goal %, runs), each run (result, run name in it) at seeds 0, 1...
# A result is a convergence.json written by this script (its runs' per-step losses, bf16 of each seed beside them)
# or a run dir (its metrics.jsonl; paired with the committed bf16 run dir of its seed). Runs named by the recipe's
# defaults of their day: the third series' plain fp8lm-o2 had bf16 weights, its plain nanotron-r2 rounded to nearest.
ROWS = [
    ("fp8-tensorwise + `--numerics.keep_first_last true`", 0.5,
     [(T3 + "keep_first_last_seeds_fp4_k2.json", "fp8-tensorwise+numerics.keep_first_last=true" + s)
      for s in ("", "+train.seed=1", "+train.seed=2")]),
    ("fp8-tensorwise", 0.5, [(T3 + "fp8lm-o2_knobs.json", "fp8-tensorwise"),
                             (T3 + "seed1_and_fp4.json", "fp8-tensorwise+train.seed=1")]),
    ("fp8-delayed", 0.5, [(T3 + "fp8-delayed_nanotron-r2.json", "fp8-delayed")]),
    ("fp8lm (FP8-LM GEMMs, fp32 optimizer)", 0.5, [(T3 + "fp8lm-o2_knobs.json", "fp8lm"),
                                                   (T3 + "seed1_and_fp4.json", "fp8lm+train.seed=1")]),
    ("fp8lm-o2 with bf16 weights (`+optim.weights=bf16`)", 0.5,
     [(T3 + "fp8lm-o2_knobs.json", "fp8lm-o2+train.compile_scope=blocks"),
      (T3 + "seed1_and_fp4.json", "fp8lm-o2+train.seed=1")]),
    ("fp8lm-o2 (FP16 weights with a per-tensor scale, its default)", 0.5,
     [("fp8lm-o2_fp16_weights_h200/convergence.json", "fp8lm-o2+optim.weights=fp16")]),
    ("nanotron-r2 rounded to nearest (`+optim.rounding=nearest`)", 0.5,
     [(T3 + "fp8-delayed_nanotron-r2.json", "nanotron-r2")]),
    ("nanotron-r2 (moments rounded stochastically, its default)", 0.5, [("nanotron-r2_stochastic_h200", "")]),
    ("fp4 + `--numerics.dge_k 2`", 2.0, [(T3 + "keep_first_last_seeds_fp4_k2.json", "fp4+numerics.dge_k=2"),
                                        (T3 + "keep_first_last_seeds_fp4_k2.json", "fp4+numerics.dge_k=2+train.seed=1")]),
    ("fp4 (DGE k = 5, the paper's)", 2.0, [(T3 + "seed1_and_fp4.json", "fp4")]),
]


def _losses(result: str, name: str) -> tuple[dict, dict, dict, dict, dict]:
    """(train, val) of the run and (train, val) of bf16 of its seed, each {step: loss}; and the result's facts."""
    seed = re.search(r"\+train\.seed=(\d+)", name)
    base = f"bf16+train.seed={seed.group(1)}" if seed else "bf16"
    path = RESULTS / result
    if path.is_dir():  # a run dir, beside the committed bf16 run of its seed
        def read(d: Path) -> tuple[dict, dict]:
            recs = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines() if x.strip()]
            return ({r["step"]: r["loss"] for r in recs if r.get("loss") is not None},
                    {r["step"]: r["val_loss"] for r in recs if "val_loss" in r})
        return (*read(path), *read(RESULTS / T3 / "bf16_runs" / base), {"dir": result})
    doc = json.loads(path.read_text())
    runs = {r["recipe"]: r for r in doc["runs"]}
    pick = lambda r, k: {int(s): v for s, v in r[k]}  # noqa: E731
    return (pick(runs[name], "train"), pick(runs[name], "val"), pick(runs[base], "train"), pick(runs[base], "val"),
            doc)


def _pct(x: float) -> str:
    s = f"{x:+.2f}%"
    return "0.00%" if s in ("+0.00%", "-0.00%") else s.replace("-", "−")  # the doc's minus sign


def _row(label: str, goal: float, runs: list) -> tuple[dict, list[dict]]:
    train_cells, val_cells, gaps, facts = [], [], [], []
    for result, name in runs:
        t, v, bt, bv, f = _losses(result, name)
        facts.append(f)
        end = max(t)
        window = range(end - 63, end + 1)
        gap = 100 * (sum(t[k] for k in window) / sum(bt[k] for k in window) - 1)
        gaps.append(gap)
        train_cells.append(_pct(gap) + ("" if end == 768 else f" (steps {window[0]}–{end})"))
        at = max(set(v) & set(bv))
        val_cells.append(_pct(100 * (v[at] / bv[at] - 1)) + ("" if at == 768 else f" (step {at})"))
    mean = sum(gaps) / len(gaps)
    met = [i for i, g in enumerate(gaps) if g <= goal]
    alone = f"seed{'s' if len(met) > 1 else ''} {', '.join(map(str, met))} alone"
    status = ("met" + (", one run" if len(gaps) == 1 else "") if len(met) == len(gaps)
              else f"met on the mean ({alone})" if mean <= goal else f"missed ({alone})" if met else "missed")
    train = ", ".join(train_cells) + (f" (mean {_pct(mean)})" if len(gaps) > 2 else "")
    return ({"recipe": label, "seeds": ", ".join(str(i) for i in range(len(runs))), "train": train,
             "val": ", ".join(val_cells), "goal": f"{goal:g}%: {status}"}, facts)


def _cell(result: str, name: str, kind: str, at: int | None) -> str:
    """One run's gap to bf16 of its seed: "train" over the 64 steps ending at `at` (default: its last step), "val" at
    step `at` (default: the last validation step both have); annotated where that is not step 768."""
    t, v, bt, bv, _ = _losses(result, name)
    if kind == "train":
        end = at or max(t)
        window = range(end - 63, end + 1)
        return _pct(100 * (sum(t[k] for k in window) / sum(bt[k] for k in window) - 1)) + (
            "" if at or end == 768 else f" (steps {window[0]}–{end})")
    step = at or max(set(v) & set(bv))
    return _pct(100 * (v[step] / bv[step] - 1)) + ("" if at or step == 768 else f" (step {step})")


def _both(label, result: str, name: str) -> tuple:
    """A knob table's row: its label cell(s), then the training window's gap and the last validation's."""
    labels = label if isinstance(label, tuple) else (label,)
    return labels, [(result, name, "train", None), (result, name, "val", None)]


FP8LM, MOM, SCALE, KFL = (T3 + x for x in ("fp8lm-o2_knobs.json", "fp8lm-o2_moment_master.json", "scaling_knobs.json",
                                           "keep_first_last_bf16_moments.json"))
FP16W = "fp8lm-o2_fp16_weights_h200/convergence.json"
MIXED = "fp8lm-o2_mixed_scales_h100/convergence.json"
# The knob tables: (header, rows); a row is (label cells, [(result, run, "train" | "val", step or None)...]).
KNOBS = {
    "scaling": (["run", "train 705–768", "val 768"], [
        _both("fp8-tensorwise", FP8LM, "fp8-tensorwise"),
        _both("fp8-tensorwise + `numerics.keep_first_last=true`", SCALE, "fp8-tensorwise+numerics.keep_first_last=true"),
        _both("fp8-tensorwise + `numerics.margin=1`", SCALE, "fp8-tensorwise+numerics.margin=1"),
        _both("fp8-tensorwise + `numerics.scaling=delayed` (history 16)", SCALE,
              "fp8-tensorwise+numerics.scaling=delayed"),
        _both("fp8-delayed", T3 + "fp8-delayed_nanotron-r2.json", "fp8-delayed"),
        _both("fp8-delayed + `numerics.keep_first_last=true`", KFL, "fp8-delayed+numerics.keep_first_last=true")]),
    "nanotron-r2": (["run", "train 705–768", "val 768"], [
        _both("nanotron-r2, rounded to nearest", T3 + "fp8-delayed_nanotron-r2.json", "nanotron-r2"),
        _both("+ `numerics.interval=1`", SCALE, "nanotron-r2+numerics.interval=1"),
        _both("+ `numerics.keep_first_last=true`", KFL, "nanotron-r2+numerics.keep_first_last=true"),
        _both("+ bf16 moments (`optim.exp_avg=bf16`, `optim.exp_avg_sq=bf16`)", KFL,
              "nanotron-r2+optim.exp_avg=bf16+optim.exp_avg_sq=bf16"),
        _both("rounded stochastically instead (`optim.rounding=stochastic`, now the default)",
              "nanotron-r2_stochastic_h200", "")]),
    "fp8lm-o2": (["run", "bytes/param (weights + states)", "train 705–768", "val 768"], [
        _both(("fp8lm", "16"), FP8LM, "fp8lm"),
        _both(("fp8lm-o2 with bf16 weights as master, E4M3 grads and m, scaled fp16 v", "6"), FP8LM,
              "fp8lm-o2+train.compile_scope=blocks"),
        _both(("+ `optim.weights=fp16` (scaled FP16 weights, their own master: the default now; compiled by block)",
               "6"), FP16W, "fp8lm-o2+optim.weights=fp16"),
        _both(("+ `optim.scales=bound` (the update in one pass; on an H100, beside a bf16 run there)", "6"),
              "fp8lm-o2_bound_scales_h100/convergence.json", "fp8lm-o2+optim.scales=bound"),
        _both(("fp8lm-o2 on that H100, against that bf16 run (two runs at once, the next row beside it)", "6"),
              MIXED, "fp8lm-o2"),
        _both(("+ `optim.scales=mixed` (the first moment's scale from its amax, the FP16 states' from bounds)", "6"),
              MIXED, "fp8lm-o2+optim.scales=mixed"),
        _both(("fp8lm-o2, compiled whole (a second run)", "6"), MOM, "fp8lm-o2"),
        _both(("+ `optim.rounding=stochastic`", "6"), FP8LM, "fp8lm-o2+optim.rounding=stochastic"),
        _both(("+ `optim.grads=bf16`", "7"), FP8LM, "fp8lm-o2+optim.grads=bf16"),
        _both(("+ `optim.exp_avg=fp32` (compiled whole)", "9"), MOM, "fp8lm-o2+optim.exp_avg=fp32"),
        _both(("+ `optim.master=fp16` (scaled; compiled whole)", "8"), MOM, "fp8lm-o2+optim.master=fp16"),
        _both(("+ `optim.master=fp32`", "10"), FP8LM, "fp8lm-o2+optim.master=fp32")]),
    "fp4": (["run", "seed 0: train 193–256", "seed 0: train 655–718", "seed 0: val 704", "seed 1: train 193–256",
             "seed 1: train 632–695", "seed 1: val 640"], [
        (("fp4 (DGE k = 5)",), [(r, n, k, at) for r, n, cols in (
            (T3 + "seed1_and_fp4.json", "fp4", (("train", 256), ("train", 718), ("val", 704))),
            (T3 + "fp4_dge.json", "fp4+train.seed=1", (("train", 256), ("train", 695), ("val", 640))))
            for k, at in cols]),
        (("fp4-no-dge (straight-through)",), [(r, n, k, at) for r, n, cols in (
            (T3 + "fp4_no_dge_weights_only.json", "fp4-no-dge", (("train", 256), ("train", 718), ("val", 704))),
            (T3 + "fp4_dge.json", "fp4-no-dge+train.seed=1", (("train", 256), ("train", 695), ("val", 640))))
            for k, at in cols]),
        (("fp4 + `numerics.dge_k=2`",), [(T3 + "keep_first_last_seeds_fp4_k2.json", n, k, at) for n, cols in (
            ("fp4+numerics.dge_k=2", (("train", 256), ("train", 718), ("val", 704))),
            ("fp4+numerics.dge_k=2+train.seed=1", (("train", 256), ("train", 695), ("val", 640))))
            for k, at in cols])]),
}


def knob_table(name: str) -> list[str]:
    header, rows = KNOBS[name]
    out = [f"| {' | '.join(header)} |", "|---|" + "---:|" * (len(header) - 1)]
    for labels, cells in rows:
        values = list(labels) + [_cell(*c) for c in cells]
        out.append(f"| {' | '.join(values)} |")
    return out


def results_table() -> list[str]:
    rows, facts = [], []
    for label, goal, runs in ROWS:
        row, f = _row(label, goal, runs)
        rows.append(row)
        facts += f
    dates = sorted({f["date"][:10] for f in facts if "date" in f})
    torch_v = sorted({f["torch"] for f in facts if "torch" in f})
    line = (f"NVIDIA H200 | torch {', '.join(torch_v)} | {dates[0]} to {dates[-1]} | `lowbit compare` runs of "
            f"`benchmarks/convergence_study.sh` (commits: *Run data*) | rewritten by `{DOC_COMMAND}` from "
            f"`benchmarks/results/convergence/`")
    out = [line, "", "| recipe (gaps to bf16 of the same seed) | seeds | train gap, last 64 steps | val gap at the end "
           "| goal (train gap) |", "|---|---:|---:|---:|---|"]
    out += [f"| {r['recipe']} | {r['seeds']} | {r['train']} | {r['val']} | {r['goal']} |" for r in rows]
    return out


def doc_main(check: bool) -> int:
    """Rewrite (or, with check, compare) every `<!-- table: convergence NAME -->` ... `<!-- end table -->` of the doc:
    NAME `results` or one of KNOBS."""
    lines, out, i = DOC.read_text().split("\n"), [], 0
    while i < len(lines):
        out.append(lines[i])
        m = re.match(r"^<!-- table: convergence (\S+) -->$", lines[i])
        i += 1
        if not m:
            continue
        if m.group(1) != "results" and m.group(1) not in KNOBS:
            print(f"{DOC.name}: unknown table {m.group(1)!r}", file=sys.stderr)
            return 2
        try:
            i = lines.index("<!-- end table -->", i)
        except ValueError:
            print(f"{DOC.name}: {lines[i - 1]} has no <!-- end table -->", file=sys.stderr)
            return 2
        out += results_table() if m.group(1) == "results" else knob_table(m.group(1))
    same = out == lines
    if check:
        print(f"{DOC.name}: tables {'up to date' if same else 'out of date'}")
        return 0 if same else 1
    DOC.write_text("\n".join(out))
    print(f"{DOC.name}: tables rewritten")
    return 0


if __name__ == "__main__" and sys.argv[1:2] in (["--doc"], ["--check-doc"]):
    sys.exit(doc_main(sys.argv[1] == "--check-doc"))


p = argparse.ArgumentParser()
p.add_argument("runs", type=Path)
p.add_argument("--eager", type=Path, help="run dirs of eager runs (shown as '<recipe> (eager)')")
p.add_argument("--out", type=Path, default=Path("."))
p.add_argument("--device", help="the GPU, where compare.json does not name it (default NVIDIA H200, the study's)")
p.add_argument("--command", help="the study script's printed COMMAND line, when compare.json is missing")
p.add_argument("--torch", help="torch version of the runs, when compare.json is missing")
p.add_argument("--date", help="date of the runs, when compare.json is missing")
p.add_argument("--window", type=int, default=64, help="steps in each training-loss window of the last table")
a = p.parse_args()
if a.window < 1:
    p.error(f"--window {a.window}: give a number of steps >= 1")


def low_precision(name: str) -> bool:  # a run dir is named by its --recipes entry, maybe a variant RECIPE+key=value
    return RECIPES[split_entry(name)[0]].linear is not None


if (a.runs / "compare.json").is_file():  # compare's own report: torch, date, command
    facts = json.loads((a.runs / "compare.json").read_text())
else:  # a compare stopped by the wall-clock limit writes none: the printed COMMAND line and torch stand in
    if not (a.command and a.torch and a.date):
        p.error(f"{a.runs / 'compare.json'} is missing: give --command, --torch and --date")
    facts = {"command": a.command, "torch": a.torch, "date": a.date, "last_n": LAST_N}
runs = {}
for d in sorted(x for x in a.runs.iterdir() if (x / "metrics.jsonl").is_file()):
    runs[d.name] = read_run(d, low_precision(d.name))
if a.eager:
    for d in sorted(x for x in a.eager.iterdir() if (x / "metrics.jsonl").is_file()):
        runs[f"{d.name} (eager)"] = read_run(d, low_precision(d.name))
order = [r for r in ("bf16", "fp8-tensorwise", "fp8-delayed", "fp8lm-o2", "nanotron-r2", "fp4") if r in runs]
order += [r for r in runs if r not in order]
bf16_runs = sorted(r for r in runs if split_entry(r)[0] == "bf16" and "eager" not in r)
if not bf16_runs:
    p.error(f"{a.runs}: no bf16 run to compare with")
base = runs["bf16" if "bf16" in runs else bf16_runs[0]]  # the plain run dir, else the first seed's


def base_of(name: str) -> dict:
    """The bf16 run a run is paired with: bf16 of its seed (`ENTRY+train.seed=S`, as compare --seeds names
    runs) where that run is here, else `base`; a seed's bf16 run itself is compared with `base` (the spread)."""
    seeds = [o.split("=", 1)[1] for o in split_entry(name.removesuffix(" (eager)"))[1] if o.startswith("--train.seed=")]
    paired = runs.get(f"bf16+train.seed={seeds[0]}", base) if seeds else base
    return base if paired is runs[name] else paired


# the entries as given to compare: a seed's run named ENTRY+train.seed=S comes from ENTRY under --seeds
entries = list(dict.fromkeys(re.sub(r"\+train\.seed=\d+$", "", r) if " --seeds " in facts["command"] else r
                             for r in order if "eager" not in r))
head, _, tail = facts["command"].partition(" --recipes ")  # compare's command, with every run's recipes
tail = re.sub(r" --(devices|out) \S+", "", re.sub(r"^\S+", "", tail))  # and without its devices and out dir
report = {"device": a.device or facts.get("device") or "NVIDIA H200", "torch": facts["torch"], "date": facts["date"],
          "command": f"{head} --recipes {','.join(entries)} --devices ...{tail}",
          "baseline": "bf16", "last_n": facts["last_n"], "runs": []}
for r in order:
    run = runs[r]
    b = base_of(r)
    report["runs"].append({"recipe": r, "action": "train", **run,
                           "train_gap_pct": _gap(run["train_loss"], b["train_loss"]),
                           "val_gap_pct": _gap(run["val_loss"], b["val_loss"])})
a.out.mkdir(parents=True, exist_ok=True)
plot(report, a.out / "convergence.png")
print(table(report))
# validation loss at common steps
steps = [s for s, _ in base["val"]]
print("\n| step | " + " | ".join(order) + " |\n|---:|" + "---:|" * len(order))
for s in steps:
    cells = []
    for r in order:
        v, ref = dict(runs[r]["val"]).get(s), dict(base_of(r)["val"]).get(s)
        cells.append("—" if v is None else f"{v:.4f}" + ("" if runs[r] is base_of(r) or ref is None
                                                         else f" ({_gap(v, ref):+.2f}%)"))
    print(f"| {s} | " + " | ".join(cells) + " |")
# training loss over windows of --window steps ending at each validation step, and at where a cut run stopped: within
# one epoch every step's batch is unseen text, the same for every run of a seed, so a window is a held-out sample
# many times the validation set's size
train = {r: dict(runs[r]["train"]) for r in order}
ref_train = {r: dict(base_of(r)["train"]) for r in order}  # each run's bf16, read once
ends = sorted({s for s, _ in base["val"]} | {runs[r]["steps"] for r in order})
print(f"\nTraining loss, mean over the {a.window} steps ending at each step, gap to bf16 of the same seed:\n")
print("| steps | " + " | ".join(order) + " |\n|---|" + "---:|" * len(order))
for e in (e for e in ends if e >= a.window):
    window, cells = range(e - a.window + 1, e + 1), []
    for r in order:
        t, ref = train[r], ref_train[r]
        whole = all(k in t and k in ref for k in window)
        cells.append(f"{_gap(sum(t[k] for k in window), sum(ref[k] for k in window)):+.2f}%" if whole else "—")
    print(f"| {window[0]}–{e} | " + " | ".join(cells) + " |")
slim = {**report, "runs": [{k: v for k, v in r.items() if k != "run_dir"} for r in report["runs"]]}
(a.out / "convergence.json").write_text(json.dumps(slim, indent=0))
