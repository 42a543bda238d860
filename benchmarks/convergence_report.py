"""docs/convergence.md's tables and plot from the study's run dirs (benchmarks/convergence_study.sh's
/tmp/study/runs, or its study.tar.gz unpacked). Uses `lowbit compare`'s own reading, table and plot; adds what compare
cannot: runs cut short, the validation loss of every run at common steps (so a run that stopped early is still
compared at the steps it reached), and the training loss over windows of --window steps. A run of another seed
(`ENTRY+train.seed=S`, as `lowbit compare --seeds` names them) is paired with bf16 of that seed. Writes
OUT/convergence.json and OUT/convergence.png and prints the tables.

  python benchmarks/convergence_report.py RUNS_DIR [--eager EAGER_RUNS_DIR] [--out DIR] [--window STEPS]
      [--command CMD --torch VERSION --date DATE]   (when RUNS_DIR has no compare.json: compare was stopped)
"""

import argparse
import json
import re
from pathlib import Path

from lowbit.numerics.recipes import RECIPES
from lowbit.tools.compare import LAST_N, _gap, plot, read_run, split_entry, table

p = argparse.ArgumentParser()
p.add_argument("runs", type=Path)
p.add_argument("--eager", type=Path, help="run dirs of eager runs (shown as '<recipe> (eager)')")
p.add_argument("--out", type=Path, default=Path("."))
p.add_argument("--device", default="NVIDIA H200")
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
report = {"device": a.device, "torch": facts["torch"], "date": facts["date"],
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
