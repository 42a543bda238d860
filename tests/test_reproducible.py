"""The same command gives the same bits on a CPU, and a run killed (SIGKILL) and resumed, again and again, equals
the uninterrupted run: each training a separate process, as a user runs it."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import SMALL, read_metrics

from lowbit.reproducible import SETTINGS, pin_cpu_numerics

RUN = [*SMALL, "--train.steps", "24", "--train.log_every", "1", "--checkpoint.every", "1", "--checkpoint.keep", "2"]


def _start(run_dir, *extra) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "lowbit", "train", *RUN, "--run.dir", str(run_dir), *extra]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _train(run_dir, *extra) -> list[dict]:
    proc = _start(run_dir, *extra)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return read_metrics(run_dir)


def _steps(metrics: list[dict]) -> dict[int, tuple]:
    """Each step's loss and gradient norm as logged last (a resumed run logs again the steps after its checkpoint)."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in metrics if "grad_norm" in r}


def test_pin_cpu_numerics_keeps_what_the_user_set(monkeypatch):
    for key in SETTINGS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MKL_DYNAMIC", "TRUE")
    assert pin_cpu_numerics() == {"MKL_CBWR": "AUTO", "MKL_DYNAMIC": "TRUE"}


@pytest.mark.slow
def test_the_same_command_twice_gives_the_same_bits(tmp_path):
    a, b = _train(tmp_path / "a"), _train(tmp_path / "b")
    assert _steps(a) == _steps(b) and len(_steps(a)) == 24  # floats round-trip through JSON exactly


@pytest.mark.slow
def test_killed_and_resumed_again_and_again_equals_the_uninterrupted_run(tmp_path):
    full = _steps(_train(tmp_path / "full"))
    run, ckpts, rng, kills = tmp_path / "killed", tmp_path / "killed" / "checkpoints", random.Random(0), 0
    for attempt in range(4):  # killed at a random moment after a new checkpoint appeared, then resumed
        proc = _start(run, *(["--run.resume"] if attempt else []))
        seen = set(os.listdir(ckpts)) if ckpts.is_dir() else set()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            new = {d for d in os.listdir(ckpts) if d.startswith("step_")} - seen if ckpts.is_dir() else set()
            if new:
                time.sleep(rng.uniform(0, 0.3))
                proc.send_signal(signal.SIGKILL)
                kills += proc.wait() == -signal.SIGKILL
                break
            time.sleep(0.01)
        else:
            assert proc.wait() == 0, proc.stderr.read()
            break
    assert kills >= 2
    resumed = _train(run, "--run.resume") if max(_steps(read_metrics(run))) < 24 else read_metrics(run)
    assert _steps(resumed) == full
