"""Trackers beside metrics.jsonl: TensorBoard and Weights & Biases (offline) receive the training scalars, the
per-layer numerics telemetry (underflow, saturation, SNR) and the memory report."""

from __future__ import annotations

import json

import pytest

from conftest import SMALL, assert_user_error, cli, read_metrics
from lowbit.train.metrics import flatten


def test_flatten_tags():
    record = {"step": 3, "loss": 2.5, "val_loss": 3.0, "skipped": True, "note": "x", "grad_norm": None,
              "numerics": {"layers.0.wq": {"input": {"underflow_pct": 0.5, "snr_db": 30.0}}},
              "optim_states": {"exp_avg": {"worst": "layers.0.wq.weight", "zero_pct": 1.0}}}
    assert flatten(record) == {"train/loss": 2.5, "val/val_loss": 3.0, "train/skipped": 1.0,
                               "numerics/layers.0.wq/input/underflow_pct": 0.5,
                               "numerics/layers.0.wq/input/snr_db": 30.0,
                               "optim_states/exp_avg/zero_pct": 1.0}


def test_wandb_missing_is_one_line(monkeypatch):
    import sys

    from lowbit.errors import LowbitError
    from lowbit.train.metrics import check_wandb

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails as where it is not installed
    with pytest.raises(LowbitError, match=r"^run.wandb: .*pip install wandb\)$"):
        check_wandb()


@pytest.mark.slow
def test_wandb_missing_refused_before_the_run_dir(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)
    assert_user_error(capsys, ["train", *SMALL, "--run.wandb", "true", "--run.dir", tmp_path / "r"],
                      "run.wandb", "pip install wandb")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_tensorboard_and_wandb_get_telemetry_and_memory(tmp_path, capsys, monkeypatch):
    pytest.importorskip("tensorboard")
    wandb = pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    logged = []
    real_log = wandb.sdk.wandb_run.Run.log

    def spy(self, data, *a, **k):  # the real offline run logs it; the test reads what was logged
        logged.append(dict(data))
        return real_log(self, data, *a, **k)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    run = tmp_path / "run"
    code, _, err = cli(capsys, "train", *SMALL, "--recipe", "fp8-tensorwise", "--train.steps", "4",
                       "--numerics.telemetry_every", "2", "--run.tensorboard", "true", "--run.wandb", "true",
                       "--run.dir", run)
    assert code == 0, err

    # TensorBoard: the event files hold the telemetry of every layer, the memory report and the losses
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    numerics = next(r["numerics"] for r in read_metrics(run) if "numerics" in r)
    for layer, ops in numerics.items():
        for op, stats in ops.items():
            for stat in ("underflow_pct", "saturated_pct", "snr_db"):
                tag = f"numerics/{layer}/{op}/{stat}"
                assert tag in tags, tag
    layer = next(iter(numerics))
    events = acc.Scalars(f"numerics/{layer}/input/snr_db")
    assert [e.step for e in events] == [1, 2, 4]
    assert events[0].value == pytest.approx(numerics[layer]["input"]["snr_db"])
    memory = json.loads((run / "memory.json").read_text())
    total = "memory/covered/bytes_per_param/total"
    assert acc.Scalars(total)[0].value == pytest.approx(memory["covered"]["bytes_per_param"]["total"])
    assert {"train/loss", "train/grad_norm", "val/val_loss"} <= tags

    # W&B: an offline run in RUN_DIR/wandb, fed the same tags against lowbit's step
    assert list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    keys = set().union(*logged)
    assert {"step", "train/loss", "val/val_loss", "memory/covered/bytes_per_param/total", "memory/model/bytes", f"numerics/{layer}/input/snr_db",
            f"numerics/{layer}/grad_output/underflow_pct"} <= keys
    assert [d["step"] for d in logged if f"numerics/{layer}/input/snr_db" in d] == [1, 2, 4]
