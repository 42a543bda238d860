"""Rewrite BENCHMARKS.md's generated tables from the JSON that `lowbit bench ... --out FILE.json` wrote.

    python benchmarks/report.py            # from the repository root: rewrite every marked table
    python benchmarks/report.py --check    # exit 1 if BENCHMARKS.md would change, or names a file that is not here

A generated table sits between two HTML comments; the script writes nothing outside them:

    <!-- table: results/step_7b_h200.json step -->
    ...
    <!-- end table -->

The path is relative to benchmarks/, the key is one of the JSON's "tables". Optional words after the key:
  a comma-separated list of row keys (`ms,tokens_per_s,peak_mem_gib`) picks and orders the columns (the first
    column, the variant, always comes first); without it the table key's default columns below are shown;
  `commit=HASH`: the commit the run measured, when the JSON's meta does not say (`lowbit bench` does not record
    it); `added=HASH`: only the commit that added the result file is known.
Between the markers goes the run's line (device | torch | torchao | date | command, from the JSON's "meta", as
`lowbit bench` prints it, overridden by the table's own "meta" where a file gathers tables of several runs; then the
commit, the file's provenance where it has one, "incomplete" when the run ended before its last row, and the step
of benchmarks/run.py that rewrites the file), then the table and its notes, rendered by `lowbit bench`'s own
Table. Every line outside the markers stays as it is. A file that no step of run.py writes is an error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "benchmarks"
try:
    import lowbit  # noqa: F401
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(ROOT / "src"))

from lowbit.tools.bench.common import Table, meta_line  # noqa: E402

sys.path.insert(0, str(HERE))
import run  # noqa: E402  (benchmarks/run.py: the steps that write each result file)

# The columns of JSON written before bench recorded its tables' columns (it does now: those are used), as the
# bench's own tables define them (src/lowbit/tools/bench/*.py), plus the row keys those tables keep in the JSON
# only (ms_min, host times...), which a marker may name for any file.
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "step": [("variant", "variant", ""), ("ms", "ms/step (median)", ".1f"), ("ms_min", "min ms", ".1f"),
             ("tokens_per_s", "tokens/s", ",.0f"), ("mfu_pct", "MFU %", ".1f"), ("speedup_vs_bf16", "vs bf16", ".3f"),
             ("vs_fp8_tensorwise", "ms vs fp8-tensorwise", ".3f"), ("ms_in_a_row", "ms/step in a row", ".1f"),
             ("mfu_in_a_row_pct", "MFU % in a row", ".1f"), ("speedup_in_a_row_vs_bf16", "vs bf16 in a row", ".3f"),
             ("peak_mem_gib", "peak GiB", ".2f"), ("reserved_gib", "reserved GiB", ".2f"),
             ("build_s", "build s", ".1f"), ("first_step_s", "first step s", ".1f")],
    "profile": [("variant", "variant", ""), ("step_ms", "step ms", ".1f"), ("forward_ms", "forward ms", ".1f"),
                ("backward_ms", "backward ms", ".1f"), ("optimizer_ms", "optimizer ms", ".1f"),
                ("gemm_ms", "GEMM kernels ms", ".1f"), ("attention_ms", "attention kernels ms", ".1f"),
                ("fused_ms", "fused kernels ms", ".1f"), ("aten_ms", "aten kernels ms", ".1f"),
                ("busy_ms", "kernels busy ms", ".1f"), ("kernel_ms", "kernel time ms (sum)", ".1f"), ("idle_ms", "GPU idle ms", ".1f"), ("kernels", "kernels", "d"),
                ("host_forward_ms", "forward host ms", ".1f"), ("host_backward_ms", "backward host ms", ".1f"),
                ("host_optimizer_ms", "optimizer host ms", ".1f"), ("host_wait_ms", "host waits ms", ".1f")],
    "optim": [("variant", "variant", ""), ("params_m", "params (M)", ",.1f"), ("covered_pct", "covered %", ".1f"),
              ("ms", "ms/step (median)", ".2f"), ("ms_min", "min ms", ".2f"),
              ("bytes_per_param", "bytes/param moved", ".2f"), ("gb_per_s", "GB/s", ",.1f"),
              ("hbm_pct", "% of HBM", ".1f"), ("vs_fp32_adamw", "ms vs fp32 AdamW", ".2f"),
              ("first_step_s", "first step s", ".1f")],
    "capacity": [("variant", "variant", ""), ("max_batch", "max batch", "d"), ("ms", "ms/step (median)", ".1f"),
                 ("tokens_per_s", "tokens/s", ",.0f"), ("tokens_vs_bf16", "tokens/s vs bf16 at its max", ".3f"),
                 ("peak_mem_gib", "peak GiB", ".2f"), ("tried", "batches tried", "")],
    "memory": [("variant", "variant", ""), ("saved_mib", "saved MiB", ",.1f"),
               ("activations_mib", "activations MiB", ",.1f"), ("activations_vs_bf16", "vs bf16", ".3f"), ("fixed_mib", "fixed MiB (weight copies)", ",.1f"),
               ("held_mib", "held after fwd MiB", ",.1f"), ("peak_mib", "fwd+bwd peak MiB", ",.1f")],
    "mlp": [("variant", "variant", ""), ("ms", "ms (median)", ".3f"), ("ms_min", "min ms", ".3f"),
            ("tflops", "TFLOP/s", ".1f"), ("speedup_vs_bf16", "speed-up vs bf16", ".2f")],
    "quantize": [("variant", "variant", ""), ("ms", "ms (median)", ".4f"), ("gb_s", "GB/s", ".0f"),
                 ("ms_back_to_back", "ms back to back", ".4f"), ("gb_s_back_to_back", "GB/s back to back", ".0f"),
                 ("ms_graph", "ms in a CUDA graph", ".4f"), ("gb_s_graph", "GB/s in a CUDA graph", ".0f")],
    "gemm": [("shape", "shape", ""), ("variant", "variant", ""), ("mkn", "M x K x N", ""), ("ms", "ms (median)", ".3f"),
             ("tflops", "TFLOP/s", ".1f"), ("speedup_vs_bf16", "vs bf16", ".2f")],
}
for _k in ("linear", "block"):
    COLUMNS[_k] = COLUMNS["mlp"]

DEFAULT = {
    "step": ["ms", "tokens_per_s", "mfu_pct", "speedup_vs_bf16", "vs_fp8_tensorwise", "peak_mem_gib", "first_step_s"],
    "profile": ["step_ms", "forward_ms", "backward_ms", "optimizer_ms", "gemm_ms", "attention_ms", "fused_ms",
                "aten_ms", "idle_ms", "kernels"],
    "optim": ["ms", "bytes_per_param", "gb_per_s", "hbm_pct", "first_step_s"],
    "capacity": ["max_batch", "ms", "tokens_per_s", "tokens_vs_bf16", "peak_mem_gib", "tried"],
    "memory": ["saved_mib", "activations_mib", "activations_vs_bf16", "fixed_mib", "held_mib", "peak_mib"],
    "mlp": ["ms", "tflops", "speedup_vs_bf16"],
    "quantize": ["ms", "ms_back_to_back", "ms_graph"],
    "gemm": ["variant", "mkn", "ms", "tflops", "speedup_vs_bf16"],
}

BEGIN = re.compile(r"^<!-- table: (\S+) (\S+)((?: \S+)*) -->$")
END = "<!-- end table -->"


class ReportError(Exception):
    pass


def render(path: str, key: str, opts: str) -> list[str]:
    """The lines between one table's markers."""
    cols, commit = None, None
    for word in opts.split():
        if word.startswith(("commit=", "added=")):
            kind, _, value = word.partition("=")
            commit = f"commit {value}" if kind == "commit" else f"commit not recorded (result added in {value})"
        elif cols is None:
            cols = word
        else:
            raise ReportError(f"{path} {key}: {word!r}: one list of columns at most")
    f = HERE / path
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{path}: {e}") from None
    if key not in doc.get("tables", {}):
        raise ReportError(f"{path}: no table {key!r} (it has {', '.join(doc.get('tables', {})) or 'none'})")
    t = doc["tables"][key]
    kind = key if key in COLUMNS else doc.get("what", key)
    spec = [tuple(c) for c in t["columns"]] if t.get("columns") else COLUMNS.get(kind, [])  # as bench wrote it
    known = {c[0]: c for c in COLUMNS.get(kind, []) + spec}
    if not known:
        raise ReportError(f"{path} {key}: no columns known for tables of kind {kind!r}; name them in the marker")
    wanted = cols.split(",") if cols else [c[0] for c in spec] if t.get("columns") else DEFAULT[kind]
    missing = [c for c in wanted if c not in known]
    if missing:
        raise ReportError(f"{path} {key}: unknown column(s) {', '.join(missing)}; known: {', '.join(known)}")
    first = spec[0]
    columns = [first] + [known[c] for c in wanted if c != first[0]]
    table = Table(key, t["title"], columns, t["rows"], list(t.get("notes", [])))
    meta = {**doc.get("meta", {}), **t.get("meta", {})}
    try:
        line = meta_line(meta)
    except KeyError as e:
        raise ReportError(f"{path} {key}: its meta has no {e}") from None
    if meta.get("commit") or commit:
        line += f" | commit {meta['commit']}" if meta.get("commit") else f" | {commit}"
    if meta.get("provenance"):
        line += f" | {meta['provenance']}"
    if doc.get("complete") is False:
        line += " | incomplete (the run ended before its last row)"
    line += f" | rewritten by {rerun(path, key)}"
    return [line, ""] + table.markdown().rstrip("\n").split("\n")


def rerun(path: str, key: str) -> str:
    """How the table's JSON is made again: the step of benchmarks/run.py that writes it."""
    s = run.step_of(Path(path).name, key)
    if s is None:
        raise ReportError(f"{path}: no step of benchmarks/run.py writes it (add one to its STEPS)")
    return run.rerun_command(s)


def rewrite(text: str) -> tuple[str, list[str]]:
    """The text with every marked table rendered again, and the markers whose table changed."""
    lines, out, changed = text.split("\n"), [], []
    i = 0
    while i < len(lines):
        m = BEGIN.match(lines[i])
        if not m and lines[i].startswith("<!-- table:"):
            raise ReportError(f"line {i + 1}: {lines[i]!r} is not <!-- table: results/FILE.json KEY [...] -->")
        out.append(lines[i])
        i += 1
        if not m:
            continue
        try:
            end = lines.index(END, i)
        except ValueError:
            raise ReportError(f"line {i}: {lines[i - 1]} has no {END}") from None
        if any(BEGIN.match(x) for x in lines[i:end]):
            raise ReportError(f"line {i}: {lines[i - 1]}: another table begins before its {END}")
        new = render(*m.groups())
        if lines[i:end] != new:
            changed.append(lines[i - 1])
        out += new + [END]
        i = end + 1
    return "\n".join(out), changed


PATH = re.compile(r"[A-Za-z0-9_./-]+\.(?:json|jsonl|txt|md|png|py|sh|toml)\b")
NOT_IN_REPO = {"memory.json"}  # the file a training run writes into its run directory


def missing_paths(text: str) -> list[str]:
    """The file names the text mentions that are not in the checkout: a name with a directory is looked up from the
    repository root (`results/...` from benchmarks/), a bare name in benchmarks/results/ and benchmarks/. Skipped:
    the outputs a command writes (`/root/out/...`, `out/...`) and placeholders (FILE.json)."""
    out = []
    for name in sorted(set(PATH.findall(text))):
        if name.startswith(("/", "out/")) or "FILE" in name or name in NOT_IN_REPO:
            continue
        if "/" in name:
            where = [HERE / name] if name.startswith("results/") else [ROOT / name]
        else:
            where = [HERE / "results" / name, HERE / name]
        if not any(w.exists() for w in where):
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the file would change")
    p.add_argument("--file", default=str(ROOT / "BENCHMARKS.md"))
    a = p.parse_args(argv)
    path = Path(a.file)
    text = path.read_text()
    try:
        new, changed = rewrite(text)
    except ReportError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    n = sum(1 for x in text.split("\n") if BEGIN.match(x))
    if a.check:
        for c in changed:
            print(f"out of date: {c}")
        missing = missing_paths(text)
        for m in missing:
            print(f"missing: {m}")
        print(f"{path.name}: {n} generated tables, {len(changed)} out of date, {len(missing)} missing files")
        return 1 if new != text or missing else 0
    if new != text:
        path.write_text(new)
    print(f"{path.name}: {n} generated tables, {len(changed)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
