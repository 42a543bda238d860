"""The docs' claims that code can check: the README's library example and docs/library.md's examples run, the
README's recipe table's bytes/param are the recipes' own; BENCHMARKS.md's tables match their JSON, every file it
names exists and every table has a step of benchmarks/run.py that writes it; docs/convergence.md's results table
matches the committed results."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lowbit.numerics.recipes import RECIPES

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_readme_library_example_runs():
    code = re.search(r"## As a library\n\n```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["loss"].isfinite() and scope["opt"].state  # a step was taken, with states


@pytest.mark.slow
def test_library_page_examples_run():
    """docs/library.md's examples, in order, as one script (its HF model needs transformers)."""
    pytest.importorskip("transformers")
    page = (Path(__file__).parent.parent / "docs" / "library.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    assert len(blocks) >= 6
    scope: dict = {"__name__": "library_md"}
    exec(compile("\n".join(blocks), "docs/library.md", "exec"), scope)
    assert scope["opt"].state and scope["mine_opt"].state and scope["stats"]
    assert len(scope["chosen"]["converted"]) == 8  # gate and up projections of 4 blocks
    assert scope["kept"] == [f"blocks.{i}.{w} (first/last block)" for i in (0, 3) for w in ("up", "down")] + \
        ["unembed (output head)"]


def test_readme_recipe_table_matches_the_recipes():
    rows = re.findall(r"^\| `([a-z0-9-]+)` \|.*\| \**(\d+)\** \|$", README, re.M)
    assert len(rows) >= 10
    for name, total in rows:
        assert RECIPES[name].optim.bytes_per_param()["total"] == int(total), name


def test_benchmarks_tables_are_their_json_and_every_named_file_exists():
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "report.py"), "--check"], cwd=root,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stdout + out.stderr


BENCH = Path(__file__).parent.parent / "benchmarks"


def _load(name: str):
    """A script of benchmarks/ as a module (they are not a package)."""
    import importlib.util

    sys.path.insert(0, str(BENCH))  # the scripts import benchmarks/tables.py by its plain name
    try:
        spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCH / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up there
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCH))


def _suite(*args: str) -> subprocess.CompletedProcess:
    root = BENCH.parent
    return subprocess.run([sys.executable, str(BENCH / "run.py"), *args], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root / "src")})


def test_benchmark_suite_lists_its_steps_and_prints_their_commands_without_running_them():
    run = _load("run")
    listed = _suite("--list")
    assert listed.returncode == 0, listed.stderr
    assert all(s.name in listed.stdout for s in run.STEPS)
    dry = _suite("--dry-run")  # the one-GPU suite: every one-GPU and CPU step that runs something, no 2-GPU step
    assert dry.returncode == 0, dry.stderr
    heads = re.findall(r"^# (\S+):", dry.stdout, re.M)
    assert heads == [s.name for s in run.STEPS if s.gpus <= 1 and s.commands]
    assert "python3 -m lowbit bench step --preset 7b" in dry.stdout and "multi_gpu.sh" not in dry.stdout
    two = _suite("--dry-run", "--only", "multi-gpu-d,grad-sync")
    assert two.returncode == 0 and "bash benchmarks/multi_gpu.sh d" in two.stdout and "torchrun" in two.stdout
    bad = _suite("--dry-run", "--only", "no-such-step")
    assert bad.returncode != 0 and "no-such-step" in bad.stderr


def test_every_benchmarks_table_has_a_step_whose_command_writes_its_json():
    run = _load("run")
    markers = re.findall(r"^<!-- table: results/(\S+) (\S+)", (BENCH.parent / "BENCHMARKS.md").read_text(), re.M)
    assert len(markers) >= 25
    for file, key in markers:
        step = run.step_of(file, key)
        assert step is not None, f"{file} {key}: no step of benchmarks/run.py writes it"
        if step.by_hand:  # written by hand from what its commands measure: say so in the table's line
            assert step.by_hand
            continue
        dev = next(run.pattern(o).match(file).group(1) for o in step.outputs if run.pattern(o).match(file))
        assert any(file in c for c in run.commands(step, "OUT", dev)), (file, step.name)


def test_suite_points_markers_at_a_new_device_and_drops_stale_commits(tmp_path):
    run = _load("run")
    md = tmp_path / "BENCHMARKS.md"
    md.write_text("<!-- table: results/step_7b_h200.json step ms,peak_mem_gib commit=390cc62 -->\n<!-- end table -->\n"
                  "<!-- table: results/step_7b_build_h200.json step ms commit=07503d3 -->\n<!-- end table -->\n"
                  "<!-- table: results/mlp_7b_h200.json quantize commit=11c3340 -->\n<!-- end table -->\n")
    assert run.repoint(md, ["step_7b_h100.json", "mlp_7b_eager_h100.json", "mlp_7b_h200.json"]) == 2
    lines = md.read_text().split("\n")
    assert lines[0] == "<!-- table: results/step_7b_h100.json step ms,peak_mem_gib -->"
    assert lines[2].endswith("step_7b_build_h200.json step ms commit=07503d3 -->")  # another measurement
    assert lines[4] == "<!-- table: results/mlp_7b_h200.json quantize -->"  # the same file again: its own commit


def test_train_table_reads_a_run_directory(tmp_path):
    run = _load("run")
    recs = [{"step": s, "loss": 10.0 - s / 10, "tokens_per_s": 1000.0 + s, "mfu": 0.5, "peak_mem_gib": 3.0}
            for s in range(5, 55, 5)] + [{"step": 50, "val_loss": 5.5, "val_ppl": 245.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    per = {"total": 6.0}
    (tmp_path / "memory.json").write_text(json.dumps({"covered": {"params": 2e9, "bytes_per_param": per},
                                                      "model": {"params": 2.1e9, "bytes_per_param": {"total": 6.25}}}))
    run.train_table(tmp_path, tmp_path / "t.json")
    rows = {r["what"]: r["value"] for r in json.loads((tmp_path / "t.json").read_text())["tables"]["train"]["rows"]}
    assert rows["bytes/param (memory.json)"] == "6.00 for the covered 2.00B, 6.25 for the model"
    assert rows["tokens/s (steps 10-50: median, range)"] == "1,030 (1,010-1,050)"
    assert rows["training loss at steps 5, 15, 25, 35, 45, 50"] == "9.50, 8.50, 7.50, 6.50, 5.50, 5.00"
    assert rows["validation loss"] == "5.50" and rows["peak GiB"] == "3.0" and rows["MFU (last logged step)"] == "50.0%"


def test_script_tables_are_made_from_the_rows_they_store():
    """performer.py, comm_bytes.py and grad_sync_bench.py write their table beside their raw results: the stored
    tables are those results'."""
    for script, file, key, make in [
        ("performer", "performer_h200.json", "performer",
         lambda m, raw: [m.performer_row(r, ["sdpa", "performer c256", "performer c1024"]) for r in raw]),
        ("comm_bytes", "comm_bytes_cpu.json", "bytes", lambda m, raw: [m.bytes_row(r, raw) for r in raw]),
        ("grad_sync_bench", "grad_sync_h200x2.json", "exchange", lambda m, doc: m.exchange_table(doc)[1]),
    ]:
        doc = json.loads((BENCH / "results" / file).read_text())
        raw = doc if script == "grad_sync_bench" else doc["rows"]
        assert doc["tables"][key]["rows"] == make(_load(script), raw), file


@pytest.mark.slow
def test_convergence_results_table_is_its_json():
    root = BENCH.parent
    out = subprocess.run([sys.executable, str(BENCH / "convergence_report.py"), "--check-doc"], cwd=root,
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root / "src")})
    assert out.returncode == 0, out.stdout + out.stderr


def test_suite_step_runs_its_commands_logs_them_and_stamps_the_commit(tmp_path):
    run = _load("run")
    write = "python3 -c \"import json; json.dump({'meta': {'device': 'cpu'}}, open('{out}/x_{dev}.json', 'w'))\""
    step = run.Step("x", "a CPU step", (write, "echo measured"), ("x_{dev}.json",), 0)
    assert run.run_step(step, tmp_path, 60, []) == ["x_cpu.json"]
    assert "measured" in (tmp_path / "x_cpu_log.txt").read_text()
    run.stamp(tmp_path / "x_cpu.json", "abc1234")
    assert json.loads((tmp_path / "x_cpu.json").read_text())["meta"] == {"device": "cpu", "commit": "abc1234"}


def test_suite_names_results_by_the_device(monkeypatch):
    import torch

    run = _load("run")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name, tag in [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA A100-SXM4-80GB", "a100")]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert run.device_tag(1) == tag and run.device_tag(2) == tag + "x2"
    assert run.device_tag(0) == "cpu"


def test_suite_bench_commands_parse():
    """Every `lowbit bench` command of the suite is one that bench accepts (parsed, not run)."""
    import argparse
    import shlex

    from lowbit.tools.bench import add_args

    run = _load("run")
    p = argparse.ArgumentParser()
    add_args(p)
    n = 0
    for step in run.STEPS:
        for c in run.commands(step, "OUT", "dev"):
            words = shlex.split(c)
            while words and "=" in words[0]:  # VAR=value before the command
                words.pop(0)
            if words[:4] == ["python3", "-m", "lowbit", "bench"]:
                p.parse_args(words[4:])
                n += 1
    assert n >= 15
