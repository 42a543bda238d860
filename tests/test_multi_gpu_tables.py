"""BENCHMARKS.md's two-GPU tables are what `multi_gpu_report.py tables` computes from the committed run records, and
its cells from a few synthetic records are the numbers those records hold."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
RESULTS = BENCH / "results"
R = "benchmarks/results/multi_gpu_h200x2"

# The commands that wrote benchmarks/results/multi_gpu_h200x2_tables.json: parts a-c at the commit their runs file
# records; d and e at the commits their BENCHMARKS.md sections name (their records do not hold one); part e kept
# no env.txt, so its line has no link or NCCL version.
COMMITTED = (
    ["--only", "tp_sp,cp,pp,long", "--env", f"{R}_env_logs.txt", f"{R}_runs.json"],
    ["--only", "dp_fsdp", "--env", f"{R}_d_env.txt", "--commit", "bef66ec", f"{R}_runs.json", f"{R}_d.jsonl"],
    ["--only", "fsdp_fp8_gather", "--date", "2026-11-30", "--commit", "bcfe357 (run 1), e20a695 (run 2)",
     f"{R}_runs.json", f"{R}_e.jsonl", f"{R}_e2.jsonl"],
)


def _tables(out: Path, args: list[str], cwd: Path = BENCH.parent) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "multi_gpu_report.py"), "tables", "--out", str(out), *args],
                          cwd=cwd, capture_output=True, text=True)


def test_committed_tables_are_what_the_committed_records_give(tmp_path):
    out = tmp_path / "tables.json"
    for args in COMMITTED:
        done = _tables(out, args)
        assert done.returncode == 0, done.stderr
    made = json.loads(out.read_text())
    committed = json.loads((RESULTS / "multi_gpu_h200x2_tables.json").read_text())
    assert set(made["tables"]) == {"tp_sp", "cp", "pp", "long", "dp_fsdp", "fsdp_fp8_gather"}
    for key, table in committed["tables"].items():
        assert made["tables"][key] == table, key


def _run(name, loss, step_s, peak=40.0, rc=0, ranks=2, **extra):
    tokens = 16 * 2048
    return {"name": name, "rc": rc, "steps_done": len(loss), "loss": loss, "val_loss": None,
            "step_s_median": step_s, "tokens_per_s_median": tokens / step_s, "device": "NVIDIA X100", "torch": "9.9",
            "ranks": [{"rank": r, "rc": rc, "error": None, "peak_mem_gib": peak,
                       "median_s": {"grad_sync": 0.010 + 0.005 * r}} for r in range(ranks)], **extra}


def _write(path: Path, runs: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in runs))
    return str(path)


def test_tables_from_synthetic_records(tmp_path):
    ref = _write(tmp_path / "abc.jsonl", [_run("ref1_1b_bf16", [10.0, 9.0, 8.0], 0.8, ranks=1),
                                          _run("ref1_1b_fp8tw", [10.0, 9.5, 9.0], 1.2, ranks=1)])
    d = _write(tmp_path / "d.jsonl", [_run("dp2_1b_bf16sync_v2", [10.0, 9.01, 8.2], 0.4, comm_bytes_grad=1234567),
                                      _run("fsdp2_1b_bf16", [10.0, 9.0, 8.0], 0.5, peak=30.04)])
    e1 = _write(tmp_path / "e1.jsonl", [_run("fsdp2_1b_fp8tw_fp8gather", [10.0, 9.5, 9.1], 0.7),
                                        _run("fsdp2_1b_fp8tw_fp32gather", [10.0, 9.5, 9.0], 0.6)])
    e2 = _write(tmp_path / "e2.jsonl", [_run("fsdp2_1b_fp8tw_fp8gather", [10.0, 9.5, 9.05], 0.65),
                                        _run("fsdp2_1b_fp8tw_fp32gather", [10.0, 9.5, 9.0], 0.75, rc=137, ranks=0)])
    env = tmp_path / "env.txt"
    env.write_text("Tue Dec  1 10:00:00 AM UTC 2026\nGPU0\t X \tNV12\t0-31\ntorch 9.9 2 nccl (2, 30, 1)\n")
    out = tmp_path / "tables.json"
    done = _tables(out, ["--only", "dp_fsdp", "--env", str(env), "--commit", "abc1234", ref, d])
    assert done.returncode == 0, done.stderr
    t = json.loads(out.read_text())["tables"]["dp_fsdp"]
    dp, fsdp = t["rows"]
    assert dp == {"run": "dp2, bf16 exchange (3 steps)", "ms_step": "400.0", "tokens_s": "81,920",
                  "grad_bytes_step_rank": "1,234,567", "grad_sync_ms": "10.0", "peak_gib": "40.0",
                  "max_abs_loss_diff_vs_1_gpu_steps_1_9_all": "0.20 / 0.20", "final_loss_1_gpu": "8.2000 (8.0000)"}
    assert fsdp["grad_bytes_step_rank"] == "not counted" and fsdp["grad_sync_ms"] == "-"
    assert fsdp["peak_gib"] == "30.0" and fsdp["max_abs_loss_diff_vs_1_gpu_steps_1_9_all"] == "0.0 / 0.0"
    assert t["meta"] == {"device": "2x NVIDIA X100 of one host (NV12)", "torch": "9.9, NCCL 2.30.1",
                         "date": "2026-12-01", "commit": "abc1234", "command": "bash benchmarks/multi_gpu.sh d",
                         "provenance": "computed by multi_gpu_report.py tables from results/d.jsonl, abc.jsonl"}
    # part e, twice: one column per file, into the same file (dp_fsdp stays)
    done = _tables(out, ["--only", "fsdp_fp8_gather", "--date", "2026-12-02", ref, e1, e2, "missing.jsonl"])
    assert done.returncode == 0 and "missing.jsonl is not there" in done.stderr
    doc = json.loads(out.read_text())
    assert set(doc["tables"]) == {"dp_fsdp", "fsdp_fp8_gather"}
    g = doc["tables"]["fsdp_fp8_gather"]
    assert [c[1] for c in g["columns"]][1:3] == ["run 1 ms/step", "run 2 ms/step"]
    fp8, fp32 = g["rows"]
    assert (fp8["run_1_ms_step"], fp8["run_2_ms_step"], fp32["run_2_ms_step"]) == ("700.0", "650.0", "750.0")
    assert fp8["max_abs_loss_diff_vs_1_gpu_fp8_tensorwis"] == "0.10 / 0.050"
    assert fp32["peak_gib"] == "40.0 / (not recorded: the time limit ended the run)"
    assert g["meta"]["command"] == "bash benchmarks/multi_gpu.sh e (twice)" and g["meta"]["date"] == "2026-12-02"


@pytest.mark.parametrize("args, error", [(["--only", "no_such"], "unknown table"),
                                         (["--only", "tp_sp"], "no run")])
def test_tables_refuses_an_unknown_table_or_one_without_its_runs(tmp_path, args, error):
    raw = _write(tmp_path / "x.jsonl", [_run("ref1_1b_bf16", [10.0], 0.8, ranks=1)])
    done = _tables(tmp_path / "t.json", [*args, raw])
    assert done.returncode != 0 and error in done.stderr
