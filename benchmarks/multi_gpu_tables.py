"""BENCHMARKS.md's two-GPU tables, computed from multi_gpu.sh's raw results (`multi_gpu_report.py tables`).

    python benchmarks/multi_gpu_report.py tables --out TABLES.json [--only KEY,...] [--env ENV.txt]
        [--commit C] [--date D] RAW...

RAW: JSON-lines files of run records (multi_gpu.sh's results.jsonl, `multi_gpu_report.py collect`) or a runs file
that gathers them by part ({"parts": {"a": [records...]}, "date", "snapshot": "... commit HASH ..."}); a later
record of a name wins, except in `fsdp_fp8_gather`, which shows each file's run side by side (run 1, run 2...).
A RAW path that is not there is skipped (a step reruns some parts, and reads the others' earlier files).
--env: the env.txt multi_gpu.sh writes (date, `nvidia-smi topo -m`, torch and NCCL versions).
Writes the tables in TABLES.json that --only names (default: every one whose runs are in RAW), keeping its other
tables; each table's meta says the device, torch, date, commit and the files it was computed from.
Every cell is computed; only the row labels (what a run is) are written here.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from multi_gpu_report import bubble, loss_diff  # noqa: E402


class Runs:
    """The run records of the RAW files: by name (a later record wins) and, per file, in order."""

    def __init__(self, paths: list[str]):
        self.by_name: dict[str, dict] = {}
        self.src: dict[str, str] = {}
        self.files: list[tuple[str, dict[str, dict]]] = []
        self.headers: dict[str, dict] = {}  # a runs file's date, device, snapshot: by file name
        for p in paths:
            path = Path(p)
            if not path.exists():
                print(f"multi_gpu_report.py tables: {p} is not there, skipped", file=sys.stderr)
                continue
            recs = self._records(path)
            self.files.append((path.name, {r["name"]: r for r in recs}))
            for r in recs:
                if r.get("rc", 0) == -1 and r["name"] in self.by_name:  # skipped for time: an earlier run stays
                    continue
                self.by_name[r["name"]] = r
                self.src[r["name"]] = path.name

    def _records(self, path: Path) -> list[dict]:
        text = path.read_text()
        if path.suffix == ".json":
            doc = json.loads(text)
            self.headers[path.name] = {k: v for k, v in doc.items() if k != "parts"}
            return [r for part in doc["parts"].values() for r in part]
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    def get(self, name: str) -> dict | None:
        return self.by_name.get(name)

    def sources(self, names) -> list[str]:
        return list(dict.fromkeys(self.src[n] for n in names if n in self.src))


def ms(r: dict | None) -> str:
    return f"{1e3 * r['step_s_median']:,.1f}" if r and r.get("step_s_median") else "-"


def tokens(r: dict | None) -> str:
    return f"{r['tokens_per_s_median']:,.0f}" if r and r.get("tokens_per_s_median") else "-"


def peak(r: dict) -> str:
    """The largest rank's peak; a run the time limit killed wrote no rank files."""
    vals = [x["peak_mem_gib"] for x in r["ranks"] if x.get("peak_mem_gib")]
    if vals:
        return f"{max(vals):.1f}"
    return "(not recorded: the time limit ended the run)" if r["rc"] in (124, 137) else "-"


def num(x) -> str:
    """A loss difference to two significant digits, trailing zero kept (0.10)."""
    return "-" if x is None else f"{x:#.2g}"


def diff(runs: Runs, a: str, ref: str, n: int | None) -> float | None:
    d = loss_diff(runs.by_name, a, ref, n)
    return d and d["max_abs"]


def count(x) -> str:
    return "-" if x is None else f"{x:,}"


def grad_sync_ms(r: dict) -> str:
    """GradSync.sync of the rank that waited least: the exchange itself."""
    t = [x["median_s"]["grad_sync"] for x in r["ranks"] if x["median_s"].get("grad_sync")]
    return f"{1e3 * min(t):.1f}" if t else "-"


def columns(*names: tuple[str, str]) -> list[list[str]]:
    return [[k, h, ""] for k, h in names]


def tp_sp(runs: Runs) -> tuple[dict, list[str]]:  # the table, the files it read
    """1b fp8-tensorwise: one GPU, dp2 (bf16, fp8 exchange), tp2, tp2 + SP; then bf16 dp2 / tp2."""
    ref, dp2 = runs.get("ref1_1b_fp8tw"), runs.get("dp2_1b_fp8tw")
    if not (ref and dp2):
        raise KeyError("ref1_1b_fp8tw, dp2_1b_fp8tw")

    def vs(r, base):
        return f"{base['step_s_median'] / r['step_s_median']:.2f}x"

    rows = [{"run": "1 GPU (2 micro-batches of 8)", "ms_step": ms(ref), "tokens_s": tokens(ref), "vs_dp2": vs(ref, dp2),
             "tp_bytes_step_rank": "-", "peak_gib": peak(ref), "max_abs_loss_diff_vs_1_gpu_steps_1_3_1_9": "-"}]
    for name, label in (("dp2_1b_fp8tw", "dp2, bf16 exchange"), ("dp2_1b_fp8tw_fp8sync", "dp2, fp8 exchange"),
                        ("tp2_1b_fp8tw", "tp2"), ("tp2sp_1b_fp8tw", "tp2 + sequence parallel (FP8 gathers)")):
        r = runs.get(name)
        if r:
            rows.append({"run": label, "ms_step": ms(r), "tokens_s": tokens(r), "vs_dp2": vs(r, dp2),
                         "tp_bytes_step_rank": count(r.get("comm_bytes_tp")), "peak_gib": peak(r),
                         "max_abs_loss_diff_vs_1_gpu_steps_1_3_1_9":
                             f"{num(diff(runs, name, 'ref1_1b_fp8tw', 3))} / {num(diff(runs, name, 'ref1_1b_fp8tw', 9))}"})
    used = ["ref1_1b_fp8tw", "dp2_1b_fp8tw", "dp2_1b_fp8tw_fp8sync", "tp2_1b_fp8tw", "tp2sp_1b_fp8tw"]
    b_dp, b_tp = runs.get("dp2_1b_bf16sync"), runs.get("tp2_1b_bf16")
    if b_dp and b_tp:
        pair = (b_dp, b_tp)
        rows.append({"run": "recipe bf16: dp2 bf16 exchange / tp2", "ms_step": " / ".join(map(ms, pair)),
                     "tokens_s": " / ".join(map(tokens, pair)), "vs_dp2": " / ".join(vs(r, b_dp) for r in pair),
                     "tp_bytes_step_rank": " / ".join(count(r.get("comm_bytes_tp")) for r in pair),
                     "peak_gib": " / ".join(map(peak, pair)),
                     "max_abs_loss_diff_vs_1_gpu_steps_1_3_1_9":
                         f"tp2: {num(diff(runs, 'tp2_1b_bf16', 'ref1_1b_bf16', 3))} / "
                         f"{num(diff(runs, 'tp2_1b_bf16', 'ref1_1b_bf16', 9))}"})
        used += ["dp2_1b_bf16sync", "tp2_1b_bf16", "ref1_1b_bf16"]
    cols = columns(("run", "run"), ("ms_step", "ms/step"), ("tokens_s", "tokens/s"), ("vs_dp2", "vs dp2"),
                   ("tp_bytes_step_rank", "TP bytes/step/rank"), ("peak_gib", "peak GiB"),
                   ("max_abs_loss_diff_vs_1_gpu_steps_1_3_1_9", "max abs loss diff vs 1 GPU, steps 1-3 / 1-9"))
    return {"title": "run", "columns": cols, "rows": rows, "notes": []}, runs.sources(used)


def oom(r: dict) -> str:
    """'out of memory (X GiB allocated, Y GiB more asked)' from a rank's OOM message."""
    text = " ".join(x.get("error") or "" for x in r["ranks"])
    asked = re.search(r"Tried to allocate ([\d.]+) GiB", text)
    held = re.search(r"([\d.]+) GiB is allocated by PyTorch", text)
    if not (asked and held):
        return "out of memory"
    return f"out of memory ({float(held.group(1)):.1f} GiB allocated, {float(asked.group(1)):.0f} GiB more asked)"


def cp(runs: Runs) -> tuple[dict, list[str]]:  # the table, the files it read
    """125m context parallel: the one-GPU 32k run, then ring's runs, then rsa's, each in the order they ran."""
    ref = runs.get("ref1_125m_32k")
    if not ref:
        raise KeyError("ref1_125m_32k")
    rows = [{"run": "1 GPU, SDPA (flash)", "seq": "32k", "ms_step": ms(ref), "tokens_s": tokens(ref),
             "cp_bytes_step_rank": "-", "peak_gib": peak(ref), "loss_diff_vs_1_gpu_5_steps": "-"}]
    used = ["ref1_125m_32k"]
    for impl in ("ring", "rsa"):
        for name, r in runs.by_name.items():
            m = re.fullmatch(rf"cp2_{impl}_(\d+k)(_ckpt)?", name)
            if not m or r["rc"] == -1:
                continue
            used.append(name)
            label = f"cp2 {impl}" + (", full activation checkpointing" if m.group(2) else "")
            if not r["steps_done"]:
                rows.append({"run": label, "seq": m.group(1), "ms_step": oom(r), "tokens_s": "",
                             "cp_bytes_step_rank": "", "peak_gib": "", "loss_diff_vs_1_gpu_5_steps": ""})
                continue
            d = diff(runs, name, "ref1_125m_32k", None) if m.group(1) == "32k" else None
            rows.append({"run": label, "seq": m.group(1), "ms_step": ms(r), "tokens_s": tokens(r),
                         "cp_bytes_step_rank": count(r.get("comm_bytes_cp")), "peak_gib": peak(r),
                         "loss_diff_vs_1_gpu_5_steps": "(other data)" if d is None
                         else "<= " + re.sub(r"e-0*", "e-", f"{d:.1e}")})
    cols = columns(("run", "run"), ("seq", "seq"), ("ms_step", "ms/step"), ("tokens_s", "tokens/s"),
                   ("cp_bytes_step_rank", "CP bytes/step/rank"), ("peak_gib", "peak GiB"),
                   ("loss_diff_vs_1_gpu_5_steps", "loss diff vs 1 GPU (5 steps)"))
    return {"title": "run", "columns": cols, "rows": rows, "notes": []}, runs.sources(used)


def pp(runs: Runs) -> tuple[dict, list[str]]:  # the table, the files it read
    """Pipeline bubble of 1F1B and GPipe: each stage's time in the schedule against its compute alone."""
    ref = runs.get("ref1_1b_bf16")
    rows, used = [], ["ref1_1b_bf16"]
    for name, label in (("pp2_1b_1f1b_m8", "1F1B"), ("pp2_1b_gpipe_m8", "GPipe")):
        r = runs.get(name)
        b = r and bubble(r)
        if not b:
            continue
        used.append(name)
        if r["rc"] != 0:
            label += f" (the time limit ended it after {r['steps_done']} steps)"
        st = [b[k] for k in sorted(k for k in b if k.startswith("stage") and k != "stages")]
        t_pipe = list(dict.fromkeys(f"{1e3 * s['pipeline_run_s']:.1f}" for s in st))  # one value where they agree
        step = ms(r) + (f" ({ref['step_s_median'] / r['step_s_median']:.2f}x one GPU)" if ref else "")
        rows.append({"schedule": label, "t_pipe_ms": " / ".join(t_pipe),
                     **{f"stage_{i}_alone_ms": f"{1e3 * s['compute_alone_s']:.1f}" for i, s in enumerate(st)},
                     **{f"idle_stage_{i}": f"{100 * s['idle_fraction']:.1f}%" for i, s in enumerate(st)},
                     "ideal_p_1_m_p_1": f"{100 * b['ideal_balanced']:.1f}%", "step_ms": step, "peak_gib": peak(r)})
    if not rows:
        raise KeyError("pp2_1b_1f1b_m8")
    cols = columns(("schedule", "schedule"), ("t_pipe_ms", "T_pipe ms"), ("stage_0_alone_ms", "stage 0 alone ms"),
                   ("stage_1_alone_ms", "stage 1 alone ms"), ("idle_stage_0", "idle stage 0"),
                   ("idle_stage_1", "idle stage 1"), ("ideal_p_1_m_p_1", "ideal (p-1)/(m+p-1)"),
                   ("step_ms", "step ms"), ("peak_gib", "peak GiB"))
    return {"title": "schedule", "columns": cols, "rows": rows, "notes": []}, runs.sources(used)


def ended(r: dict) -> str:
    """Steps done, and how a run the time limit ended stopped: by the trainer's signal handler or killed."""
    n = str(r["steps_done"])
    if r["rc"] not in (124, 137):
        return n
    if any("stopped by signal" in x for x in r.get("log_tail", [])):
        return f"{n} (the time limit stopped it; the trainer wrote its checkpoint)"
    return f"{n} (the time limit killed it after its last logged step)"


def long(runs: Runs) -> tuple[dict, list[str]]:  # the table, the files it read
    """125m fp8-tensorwise for a few hundred steps: one GPU, tp2 + SP, dp2 + ZeRO-1 + fp8 exchange. The loss
    windows end where the shortest run stopped, so that every run has the same steps in each but the last."""
    names = (("ref1_125m_fp8tw_300", "1 GPU"), ("tp2sp_125m_fp8tw_300", "tp2 + sequence parallel"),
             ("dp2z1_125m_fp8tw_fp8sync_300", "dp2 + ZeRO-1 + fp8 exchange"))
    found = [(n, label, runs.get(n)) for n, label in names if runs.get(n)]
    if not found or found[0][0] != "ref1_125m_fp8tw_300":
        raise KeyError("ref1_125m_fp8tw_300")
    last = max(len(r["loss"]) for _, _, r in found)
    stop = min(len(r["loss"]) for _, _, r in found)
    windows = [(1, 50), (101, 150), (201, stop)] + ([(stop + 1, last)] if stop < last else [])
    rows = []
    for name, label, r in found:
        means = [r["loss"][a - 1:b] for a, b in windows]
        d = diff(runs, name, "ref1_125m_fp8tw_300", 9) if name != "ref1_125m_fp8tw_300" else None
        rows.append({"run": label, "steps": ended(r), "ms_step": ms(r), "max_abs_loss_diff_steps_1_9": num(d),
                     "mean_loss_steps_1_50_101_150_201_235_236":
                         " / ".join(f"{sum(x) / len(x):.3f}" if x else "-" for x in means),
                     "val_loss": f"{r['val_loss']:.3f} (step {r['steps_done']})" if r.get("val_loss") else "-"})
    cols = columns(("run", "run"), ("steps", "steps"), ("ms_step", "ms/step"),
                   ("max_abs_loss_diff_steps_1_9", "max abs loss diff, steps 1-9"),
                   ("mean_loss_steps_1_50_101_150_201_235_236",
                    "mean loss, steps " + " / ".join(f"{a}-{b}" for a, b in windows)), ("val_loss", "val loss"))
    return {"title": "run", "columns": cols, "rows": rows, "notes": []}, runs.sources([n for n, _, _ in found])


DP_FSDP = (("dp2_1b_bf16sync_v2", "dp2, bf16 exchange ({n} steps)"),
           ("dp2_1b_fp8sync_v2", "dp2, fp8 exchange ({n} steps)"),
           ("fsdp2_1b_bf16", "FSDP2 dp_shard 2, bf16 reduce-scatter ({n} steps, writes its DCP checkpoint)"),
           ("fsdp2_1b_fp8tw", "FSDP2 dp_shard 2, fp8-tensorwise, bf16 reduce ({n} steps)"))


def dp_fsdp(runs: Runs) -> tuple[dict, list[str]]:  # the table, the files it read
    """Part d: dp2 with the rewritten exchange and FSDP2, against part a/c's one-GPU runs of the same recipe.
    FSDP2's all-gathers and reduce-scatters are not in comm_bytes, and it has no GradSync."""
    rows, used = [], []
    for name, label in DP_FSDP:
        r = runs.get(name)
        if not r:
            continue
        ref = "ref1_1b_fp8tw" if "fp8tw" in name else "ref1_1b_bf16"
        fsdp = name.startswith("fsdp")
        final = f"{r['loss'][-1]:.4f}" if r["loss"] else "-"
        if runs.get(ref) and runs.get(ref)["loss"]:
            final += f" ({runs.get(ref)['loss'][-1]:.4f})"
        rows.append({"run": label.format(n=r["steps_done"]), "ms_step": ms(r), "tokens_s": tokens(r),
                     "grad_bytes_step_rank": "not counted" if fsdp else count(r.get("comm_bytes_grad")),
                     "grad_sync_ms": "-" if fsdp else grad_sync_ms(r), "peak_gib": peak(r),
                     "max_abs_loss_diff_vs_1_gpu_steps_1_9_all":
                         f"{num(diff(runs, name, ref, 9))} / {num(diff(runs, name, ref, None))}",
                     "final_loss_1_gpu": final})
        used += [name, ref]
    if not rows:
        raise KeyError(", ".join(n for n, _ in DP_FSDP))
    cols = columns(("run", "run"), ("ms_step", "ms/step"), ("tokens_s", "tokens/s"),
                   ("grad_bytes_step_rank", "grad bytes/step/rank"), ("grad_sync_ms", "grad sync ms"),
                   ("peak_gib", "peak GiB"),
                   ("max_abs_loss_diff_vs_1_gpu_steps_1_9_all", "max abs loss diff vs 1 GPU, steps 1-9 / all"),
                   ("final_loss_1_gpu", "final loss (1 GPU)"))
    return {"title": "run", "columns": cols, "rows": rows, "notes": []}, runs.sources(used)


def fsdp_fp8_gather(runs: Runs) -> tuple[dict, list[str]]:  # the table, the files it read
    """Part e: FSDP2 fp8-tensorwise with FP8 against fp32 weight all-gathers; one column per RAW file that ran
    it (the step time varies between runs more than the gather changes it)."""
    files = [(f, recs) for f, recs in runs.files if "fsdp2_1b_fp8tw_fp8gather" in recs]
    if not files:
        raise KeyError("fsdp2_1b_fp8tw_fp8gather")
    ref = runs.get("ref1_1b_fp8tw")
    rows = []
    for name, label in (("fsdp2_1b_fp8tw_fp8gather", "weights all-gathered as E4M3 bytes (154 linears)"),
                        ("fsdp2_1b_fp8tw_fp32gather", "weights all-gathered in fp32")):
        each = [recs.get(name) for _, recs in files]
        row = {"run": label, **{f"run_{i + 1}_ms_step": ms(r) for i, r in enumerate(each)},
               "peak_gib": " / ".join(dict.fromkeys(peak(r) for r in each if r))}
        diffs = [loss_diff({name: r, "ref": ref}, name, "ref", 9) if r and ref else None for r in each]
        row["max_abs_loss_diff_vs_1_gpu_fp8_tensorwis"] = " / ".join(num(d and d["max_abs"]) for d in diffs)
        rows.append(row)
    cols = columns(("run", "run"), *((f"run_{i + 1}_ms_step", f"run {i + 1} ms/step") for i in range(len(files))),
                   ("peak_gib", "peak GiB"),
                   ("max_abs_loss_diff_vs_1_gpu_fp8_tensorwis", "max abs loss diff vs 1 GPU (fp8-tensorwise), steps 1-9"
                    + (", run " + " / ".join(str(i + 1) for i in range(len(files))) if len(files) > 1 else "")))
    return ({"title": "run", "columns": cols, "rows": rows, "notes": []},
            [f for f, _ in files] + runs.sources(["ref1_1b_fp8tw"]))


TABLES = {"tp_sp": tp_sp, "cp": cp, "pp": pp, "long": long, "dp_fsdp": dp_fsdp, "fsdp_fp8_gather": fsdp_fp8_gather}
PARTS = {"tp_sp": "a, b, c", "cp": "a, b, c", "pp": "a, b, c", "long": "a, b, c", "dp_fsdp": "d",
         "fsdp_fp8_gather": "e"}  # the multi_gpu.sh parts of each table's step of benchmarks/run.py


def env_facts(path: str) -> dict:
    """From multi_gpu.sh's env.txt: the first `date -u` line's day, the GPUs' link, the NCCL version."""
    text = Path(path).read_text() if path else ""
    out = {}
    m = re.search(r"^\w{3} (\w{3}) +(\d+) .*UTC (\d{4})$", text, re.M)
    if m:
        out["date"] = datetime.datetime.strptime(" ".join(m.groups()), "%b %d %Y").date().isoformat()
    m = re.search(r"^GPU0\s+X\s+(NV\d+)", text, re.M)
    if m:
        out["link"] = m.group(1)
    m = re.search(r"nccl \((\d+), (\d+), (\d+)\)", text)
    if m:
        out["nccl"] = ".".join(m.groups())
    return out


def head_commit() -> str:
    from run import commit

    return commit("")


def meta(runs: Runs, key: str, sources: list[str], a: argparse.Namespace, env: dict) -> dict:
    """The table's run line: device, torch, date, commit and command, and the files it was computed from."""
    recs = [r for r in runs.by_name.values() if runs.src[r["name"]] in sources and r.get("device")]
    gpus = max((len(r["ranks"]) for r in recs), default=2)
    device = f"{gpus}x {recs[0]['device'] if recs else 'GPU'}" + (f" of one host ({env['link']})" if "link" in env
                                                                    else "")
    torch = (recs[0].get("torch") if recs else None) or "not recorded"
    header = runs.headers.get(sources[0], {}) if sources else {}
    snapshot = re.search(r"commit (\w+)", header.get("snapshot", ""))
    date = a.date or env.get("date") or header.get("date") or datetime.date.today().isoformat()
    n = sum(1 for f, recs_ in runs.files if f in sources and "fsdp2_1b_fp8tw_fp8gather" in recs_)  # run k columns
    command = f"bash benchmarks/multi_gpu.sh {PARTS[key]}" + {0: "", 1: "", 2: " (twice)"}.get(n, f" ({n} times)")
    return {"device": device, "torch": torch + (f", NCCL {env['nccl']}" if "nccl" in env else ""), "date": date,
            "provenance": "computed by multi_gpu_report.py tables from results/" + ", ".join(sources),
            "commit": a.commit or (snapshot.group(1) if snapshot else head_commit()), "command": command}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="multi_gpu_report.py tables", description=__doc__.split("\n\n")[0])
    p.add_argument("raw", nargs="+", help="results JSON lines or a runs file (a later record of a name wins)")
    p.add_argument("--out", required=True, help="the tables JSON; its tables that are not written stay")
    p.add_argument("--only", default="", help=f"comma-separated tables among {', '.join(TABLES)}")
    p.add_argument("--env", default="", help="multi_gpu.sh's env.txt: date, link, NCCL version")
    p.add_argument("--commit", default="", help="the commit measured (default: the runs file's snapshot, else HEAD)")
    p.add_argument("--date", default="", help="the day of the runs (default: --env's, the runs file's, today)")
    a = p.parse_args(argv)
    keys = [k.strip() for k in a.only.split(",") if k.strip()] or list(TABLES)
    bad = [k for k in keys if k not in TABLES]
    if bad:
        p.error(f"unknown table(s) {', '.join(bad)}")
    runs, env, out = Runs(a.raw), env_facts(a.env), Path(a.out)
    doc = json.loads(out.read_text()) if out.exists() else {"meta": {}, "what": "table", "complete": True, "tables": {}}
    written = []
    for key in keys:
        try:
            table, sources = TABLES[key](runs)
        except KeyError as e:
            if a.only:
                raise SystemExit(f"multi_gpu_report.py tables: {key}: no run {e} in {', '.join(a.raw)}") from None
            continue
        table["meta"] = meta(runs, key, sources, a, env)
        doc["tables"][key] = table
        doc["meta"] = dict(table["meta"])  # the latest table's run: what `run.py` stamps its commit on
        written.append(key)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{out}: {', '.join(written) or 'no table'} written")
    return 0
