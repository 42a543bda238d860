"""`lowbit compare`: runs under each recipe, the report, and re-runs that skip, resume or restart."""

import json

import pytest

from conftest import SMALL, cli, losses

RECIPES = "bf16,fp8-tensorwise"
ARGS = [*SMALL, "--train.steps", "6", "--numerics.telemetry_every", "3"]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    from lowbit.cli import main

    out = tmp_path_factory.mktemp("compare") / "out"
    assert main(["compare", "--recipes", RECIPES, "--out", str(out), *ARGS]) == 0
    return out


@pytest.mark.slow
def test_compare_writes_the_report(compared):
    for name in ("compare.png", "compare.md", "compare.json"):
        assert (compared / name).stat().st_size > 100
    report = json.loads((compared / "compare.json").read_text())
    assert report["baseline"] == "bf16" and report["command"].startswith("lowbit compare --recipes")
    bf16, fp8 = report["runs"]
    assert (bf16["recipe"], fp8["recipe"]) == ("bf16", "fp8-tensorwise")
    assert bf16["val_gap_pct"] == 0 and bf16["train_gap_pct"] == 0 and bf16["underflow"] is None
    assert bf16["steps"] == fp8["steps"] == 6 and fp8["val_loss"] is not None
    # the same seed and data: FP8 emulation moves the loss a little, not a lot
    assert fp8["val_gap_pct"] == pytest.approx(100 * (fp8["val_loss"] / bf16["val_loss"] - 1)) and \
        abs(fp8["val_gap_pct"]) < 1
    assert fp8["underflow"]["step"] == 6 and fp8["saturated"]["pct"] >= 0
    table = (compared / "compare.md").read_text()
    assert "torch" in table.splitlines()[0] and "`lowbit compare" in table.splitlines()[0]
    assert "| bf16 | 6 |" in table and "+0.00% | +0.00% |" in table and "| fp8-tensorwise | 6 |" in table


def test_compare_rerun_skips_finished_runs(compared, capsys):
    mtimes = {r: (compared / r / "metrics.jsonl").stat().st_mtime_ns for r in RECIPES.split(",")}
    code, out, _ = cli(capsys, "compare", "--recipes", RECIPES, "--out", compared, *ARGS)
    assert code == 0 and out.count("skipped, finished run") == 2 and "step " not in out
    assert mtimes == {r: (compared / r / "metrics.jsonl").stat().st_mtime_ns for r in RECIPES.split(",")}
    assert "Trained by an earlier command" in out
    # another config over the same runs is refused, not mixed in
    code, _, err = cli(capsys, "compare", "--recipes", RECIPES, "--out", compared, *ARGS, "--train.lr", "2e-3")
    assert code == 2 and "another config" in err and len(err.strip().splitlines()) == 1


def test_compare_last_n_sets_the_window_of_the_final_training_loss(compared, tmp_path, capsys):
    import shutil

    out = tmp_path / "out"
    for r in RECIPES.split(","):  # the finished runs, reported again (skipped, not retrained)
        shutil.copytree(compared / r, out / r)
    code, text, _ = cli(capsys, "compare", "--recipes", RECIPES, "--out", out, "--last-n", "3", *ARGS)
    assert code == 0 and text.count("skipped, finished run") == 2 and "mean of the last 3 steps" in text
    report = json.loads((out / "compare.json").read_text())
    assert report["last_n"] == 3
    for run in report["runs"]:
        losses = [json.loads(line).get("loss") for line in (out / run["recipe"] / "metrics.jsonl").open()]
        last = [x for x in losses if x is not None][-3:]
        assert run["train_loss"] == pytest.approx(sum(last) / 3)
    code, _, err = cli(capsys, "compare", "--recipes", RECIPES, "--out", out, "--last-n", "0", *ARGS)
    assert code == 2 and "--last-n 0" in err and len(err.strip().splitlines()) == 1


def test_compare_resumes_or_restarts_unfinished_runs(compared, tmp_path, capsys):
    import shutil

    out = tmp_path / "out"
    assert cli(capsys, "compare", "--recipes", RECIPES, "--out", out, *ARGS, "--train.stop_at", "3")[0] == 0
    shutil.rmtree(out / "fp8-tensorwise" / "checkpoints")  # as if killed before its first checkpoint
    (out / "fp8-tensorwise" / "summary.json").unlink()
    code, text, _ = cli(capsys, "compare", "--recipes", RECIPES, "--out", out, *ARGS)
    assert code == 0 and "bf16: resuming" in text and "fp8-tensorwise: restarting" in text
    for r in RECIPES.split(","):  # and both end where the uninterrupted runs did, bit for bit
        assert losses(out / r) == losses(compared / r)


def test_compare_bad_arguments_train_nothing(tmp_path, capsys):
    for args, message in ((["--recipes", "bf16,fp9"], "'fp9' is not one of"),
                          (["--recipes", "bf16,bf16"], "twice"),
                          (["--recipes", "bf16", "--recipe", "fp4"], "--recipe is set by compare"),
                          (["--recipes", "bf16", "--train.nope", "1"], "unknown config key")):
        code, out, err = cli(capsys, "compare", *args, "--out", tmp_path / "out", *ARGS)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "out").exists() and "step" not in out


@pytest.mark.slow
def test_compare_on_devices_runs_each_recipe_in_its_own_process(compared, tmp_path, capsys):
    out = tmp_path / "out"
    code, text, _ = cli(capsys, "compare", "--recipes", RECIPES, "--out", out, "--devices", "cpu,cpu", *ARGS)
    assert code == 0 and text.count(" on cpu (log ") == 2 and text.count("finished after") == 2
    for r in RECIPES.split(","):  # a child process trains what this process trained
        assert (out / f"{r}.log").stat().st_size > 0 and not (out / f".{r}.toml").exists()
        assert losses(out / r) == pytest.approx(losses(compared / r), rel=1e-5)
    assert json.loads((out / "compare.json").read_text())["runs"][1]["val_loss"] is not None
    code, text, _ = cli(capsys, "compare", "--recipes", RECIPES, "--out", out, "--devices", "cpu", *ARGS)
    assert code == 0 and text.count("skipped, finished run") == 2 and " on cpu" not in text
    for args, message in ((["--devices", "gpu0"], "'gpu0' is not cpu, cuda or cuda:N"),
                          (["--devices", "cpu,cuda:0"], "mixes cpu and cuda"),
                          (["--devices", "cpu", "--run.device", "cpu"], "give one")):
        code, _, err = cli(capsys, "compare", "--recipes", RECIPES, "--out", out, *args, *ARGS)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)


@pytest.mark.slow
def test_compare_on_devices_passes_a_signal_to_its_runs(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    out, args = tmp_path / "out", ["--recipes", "bf16", "--devices", "cpu", *SMALL, "--train.steps", "400",
                                   "--train.log_every", "1", "--train.eval_every", "0"]
    parent = subprocess.Popen([sys.executable, "-m", "lowbit", "compare", "--out", str(out), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ)
    log, deadline = out / "bf16.log", time.monotonic() + 120
    while not (log.exists() and "step" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)  # the child is in its training loop
    parent.send_signal(signal.SIGTERM)
    text, err = parent.communicate(timeout=120)
    assert parent.returncode == 2 and "stopped by a signal" in err, err
    assert "bf16: stopped at step " in text and "of 400 after" in text and "finished" not in text, text
    assert "stopped by signal after step" in log.read_text() and not (out / ".bf16.toml").exists()
    stopped_at = max(losses(out / "bf16"))
    assert 0 < stopped_at < 400  # the child stopped early, with a checkpoint that compare resumes from
    done = subprocess.run([sys.executable, "-m", "lowbit", "compare", "--out", str(out), *args,
                           "--train.stop_at", str(stopped_at + 2)], capture_output=True, text=True, env=os.environ)
    assert done.returncode == 0 and "bf16: resuming" in done.stdout, done.stderr


@pytest.mark.slow
def test_compare_on_devices_reports_a_failed_run(tmp_path, capsys):
    out = tmp_path / "out"  # a missing dataset passes the config checks here and fails in the child
    code, _, err = cli(capsys, "compare", "--recipes", "bf16", "--out", out, "--devices", "cpu", *ARGS,
                       "--data.path", str(tmp_path / "missing"))
    assert code == 2 and "bf16 failed: see the end of" in err and "bf16.log" in err
    assert "not found" in (out / "bf16.log").read_text()


def test_compare_variant_entries_parse():
    from lowbit.tools.compare import parse_recipes

    entries = parse_recipes("bf16, nanotron-r2+optim.exp_avg=fp32+numerics.keep_first_last=true,bf16+train.lr=1e+3")
    assert entries == {"bf16": ("bf16", []),
                       "nanotron-r2+optim.exp_avg=fp32+numerics.keep_first_last=true":
                           ("nanotron-r2", ["--optim.exp_avg=fp32", "--numerics.keep_first_last=true"]),
                       "bf16+train.lr=1e+3": ("bf16", ["--train.lr=1e+3"])}  # the + of 1e+3 is the value's


def test_compare_trains_variants_in_their_own_dirs(compared, tmp_path, capsys):
    import shutil

    out, recipes = tmp_path / "out", "bf16,bf16+train.lr=0.002"
    assert cli(capsys, "compare", "--recipes", recipes, "--out", out, *ARGS)[0] == 0
    assert "lr = 0.002" in (out / "bf16+train.lr=0.002" / "config.toml").read_text()
    assert losses(out / "bf16") == losses(compared / "bf16") != losses(out / "bf16+train.lr=0.002")
    report = json.loads((out / "compare.json").read_text())
    assert [r["recipe"] for r in report["runs"]] == ["bf16", "bf16+train.lr=0.002"]
    assert "| bf16+train.lr=0.002 | 6 |" in (out / "compare.md").read_text()
    code, text, _ = cli(capsys, "compare", "--recipes", recipes, "--out", out, *ARGS)
    assert code == 0 and text.count("skipped, finished run") == 2
    # a variant's dir trained with another value of its key is refused
    shutil.copytree(out / "bf16+train.lr=0.002", out / "bf16+train.lr=0.003")
    code, _, err = cli(capsys, "compare", "--recipes", "bf16+train.lr=0.003", "--out", out, *ARGS)
    assert code == 2 and "another config" in err


def test_compare_bad_variants_train_nothing(tmp_path, capsys):
    for args, message in ((["--recipes", "bf16,bf16+train.nope=1"], "'bf16+train.nope=1': unknown config key"),
                          (["--recipes", "bf16+train.lr=fast"], "train.lr: "),
                          (["--recipes", "fp9+train.lr=1"], "'fp9' is not one of"),
                          (["--recipes", "bf16+run.dir=x"], "--run.dir is set by compare"),
                          (["--recipes", "bf16+run.resume=true"], "--run.resume is set by compare"),
                          (["--recipes", "bf16+run.device=cpu", "--devices", "cpu"], "give one"),
                          (["--recipes", "bf16+data.path=/data"], "no directory name"),
                          (["--recipes", "bf16+train.lr=2e-3,bf16+train.lr=2e-3"], "twice")):
        code, out, err = cli(capsys, "compare", *args, "--out", tmp_path / "out", *ARGS)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "out").exists() and "step" not in out


def test_compare_reports_the_stuck_optimizer_moments(tmp_path):
    from lowbit.tools.compare import read_run, table

    m = {"kind": "e4m3", "zero_pct": 10.0, "stuck_pct": 3.14, "worst": "layers.0.w1", "worst_stuck_pct": 9.0}
    states = {"exp_avg": m, "exp_avg_sq": {**m, "kind": "e5m2", "stuck_pct": 97.0, "m_nonzero_v_zero_pct": 1.0,
                                           "subnormal_pct": 0.25}}
    records = [{"step": 1, "loss": 5.0}, {"step": 3, "optim_states": {"exp_avg": m}}, {"step": 3, "loss": 4.0},
               {"step": 6, "optim_states": states}, {"step": 6, "loss": 3.0}]
    runs = []
    for name, lines in (("with", records), ("without", records[:1])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        runs.append({"recipe": name, "action": "train", **read_run(tmp_path / name, False),
                     "train_gap_pct": None, "val_gap_pct": None})
    assert runs[0]["moments"] == states and runs[0]["moments_step"] == 6 and runs[0]["steps"] == 6  # the last
    assert runs[1]["moments"] is None and runs[1]["moments_step"] is None
    text = table({"device": "cpu", "torch": "x", "date": "d", "command": "c", "baseline": "with", "runs": runs})
    assert "moments (stuck / subnormal % of non-zeros) |" in text and "leaves unchanged" in text
    assert "| m e4m3 3.14%, v e5m2 97% / 0.25% |" in text and text.splitlines()[-1].endswith("| — | — | — |")


def test_a_run_dir_from_before_a_new_config_key_is_still_the_same_config():
    from lowbit.tools.compare import _flat_config, _same_config
    from lowbit.train.config import to_toml
    from lowbit.train.plan import load_config

    now = _flat_config(to_toml(load_config(None, ["--train.lr=0.002"])))
    old = {k: v for k, v in now.items() if k != "optim.rounding"}  # written before optim.rounding existed
    assert _same_config(old, now)
    assert not _same_config(old, {**now, "optim.rounding": "stochastic"})  # a new key set away from its default
    assert not _same_config({**old, "train.lr": 0.001}, now)


def test_compare_seeds_pairs_each_run_with_bf16_of_its_seed(compared, tmp_path, capsys):
    out = tmp_path / "out"
    code, text, _ = cli(capsys, "compare", "--recipes", RECIPES, "--seeds", "0,1", "--out", out, *ARGS)
    assert code == 0
    report = json.loads((out / "compare.json").read_text())
    names = [r["recipe"] for r in report["runs"]]
    assert names == ["bf16+train.seed=0", "fp8-tensorwise+train.seed=0", "bf16+train.seed=1",
                     "fp8-tensorwise+train.seed=1"]
    assert "seed = 1" in (out / "bf16+train.seed=1" / "config.toml").read_text()
    assert losses(out / "bf16+train.seed=0") == losses(compared / "bf16")  # seed 0 is the config's default
    assert losses(out / "bf16+train.seed=1") != losses(compared / "bf16")
    run = {r["recipe"]: r for r in report["runs"]}
    fp8_1, bf16_1 = run["fp8-tensorwise+train.seed=1"], run["bf16+train.seed=1"]
    assert fp8_1["val_gap_pct"] == pytest.approx(100 * (fp8_1["val_loss"] / bf16_1["val_loss"] - 1))  # same seed
    assert report["seeds"] == [0, 1]
    summary = {r["entry"]: r for r in report["seed_summary"]}
    gaps = [run[f"fp8-tensorwise+train.seed={s}"]["val_gap_pct"] for s in (0, 1)]
    assert summary["fp8-tensorwise"]["val_gap_pct"] == pytest.approx(
        {"mean": sum(gaps) / 2, "min": min(gaps), "max": max(gaps)})
    bf16_val = [run[f"bf16+train.seed={s}"]["val_loss"] for s in (0, 1)]
    assert summary["bf16"]["val_loss_spread_pct"] == pytest.approx(
        100 * (max(bf16_val) - min(bf16_val)) / (sum(bf16_val) / 2))
    assert summary["fp8-tensorwise"]["runs"] == 2 and not summary["fp8-tensorwise"]["unfinished"]
    assert "Over seeds 0, 1" in text and "| fp8-tensorwise | 2 |" in text and "| bf16 | 2 | — | — |" in text
    code, text, _ = cli(capsys, "compare", "--recipes", RECIPES, "--seeds", "0,1", "--out", out, *ARGS)
    assert code == 0 and text.count("skipped, finished run") == 4
    for args, message in ((["--seeds", "0,x"], "not a comma-separated list"), (["--seeds", "1,1"], "twice"),
                          (["--seeds", "1", "--train.seed", "2"], "--train.seed and --seeds"),
                          (["--seeds", "1", "--recipes", "bf16+train.seed=3"], "sets train.seed")):
        if "--recipes" not in args:
            args = [*args, "--recipes", RECIPES]
        code, _, err = cli(capsys, "compare", *args, "--out", tmp_path / "bad", *ARGS)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (args, err)
        assert not (tmp_path / "bad").exists()


def test_compare_refuses_a_gpu_that_is_not_here_before_launching(monkeypatch):
    import torch

    from lowbit.errors import LowbitError
    from lowbit.tools.compare import parse_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert parse_devices("cuda:0,cuda") == ["cuda:0", "cuda"]
    with pytest.raises(LowbitError, match="cuda:1 is not here"):
        parse_devices("cuda:0,cuda:1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(LowbitError, match="no GPU"):
        parse_devices("cuda:0")
