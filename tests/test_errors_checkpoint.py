"""Checkpoint failures and damage: a failed save leaves nothing half-written and says why on one line; resume
skips a damaged latest checkpoint for the previous good one, and drops a metrics line cut short by a crash."""

import errno
import hashlib
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from conftest import SMALL, assert_user_error, cli, read_metrics, snapshot
from lowbit.data import default_dataset
from lowbit.errors import LowbitError
from lowbit.train import checkpoint as ckpt
from lowbit.train.metrics import truncate_after


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = default_dataset()
    dst = tmp_path_factory.mktemp("ds") / "data"
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset) -> Path:
    """A run of 2 steps with checkpoints at steps 1 and 2, for tests to copy and damage."""
    run = tmp_path_factory.mktemp("trained") / "run"
    code = main_quiet("train", *SMALL, "--data.path", dataset, "--train.steps", "2", "--checkpoint.every", "1",
                      "--run.dir", run)
    assert code == 0
    return run


def main_quiet(*args) -> int:
    from lowbit.cli import main

    return main([str(a) for a in args])


def resume_args(dataset, run, steps=3):
    return ["train", *SMALL, "--data.path", dataset, "--train.steps", str(steps), "--checkpoint.every", "1",
            "--run.dir", run, "--run.resume"]


def remanifest(path: Path) -> None:
    """Rewrite the manifest to match the files: damage made before the manifest was written."""
    manifest = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
                for f in sorted(path.iterdir()) if f.name != "manifest.json"}
    (path / "manifest.json").write_text(json.dumps(manifest))


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def no_space_in_dcp(state_dict, checkpoint_id, **kwargs):
    (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"x" * 1000)  # a partial write
    raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})


@pytest.mark.slow
@pytest.mark.parametrize("fail", [no_space_in_dcp, no_space])
def test_disk_full_during_save(capsys, tmp_path, dataset, trained, monkeypatch, fail):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    before = snapshot(run / "checkpoints")
    monkeypatch.setattr(ckpt.dcp, "save", fail)
    line = assert_user_error(capsys, resume_args(dataset, run), "no space left on device", "step_00000003")
    assert str(run / "checkpoints") in line
    assert not list((run / "checkpoints").glob(".tmp-*"))
    assert snapshot(run / "checkpoints") == before


def test_failed_small_files_remove_the_temporary_directory(tmp_path, monkeypatch):
    tmp = ckpt.begin(tmp_path, 5)
    monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("write failed")))
    with pytest.raises(LowbitError, match="step_00000005"):
        ckpt.commit(tmp_path, 5, tmp, {}, {}, keep=2)
    assert not tmp.exists()


def test_dcp_single_process_warning_is_silenced(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(tmp_path, 1, {"model.w": torch.ones(3)}, {}, {}, keep=2)
        path = ckpt.list_checkpoints(tmp_path)[-1]
        t = {"model.w": torch.zeros(3)}
        ckpt.load_tensors(path, t)
        assert ckpt.read_whole(path)["w"].tolist() == [1, 1, 1]
    assert t["model.w"].tolist() == [1, 1, 1]


def damage_state(path):
    (path / "state.pt").write_bytes(b"garbage")
    remanifest(path)


def damage_info(path):
    info = json.loads((path / "trainer.json").read_text())
    del info["tokens_seen"]
    (path / "trainer.json").write_text(json.dumps(info))
    remanifest(path)


def damage_manifest(path):
    (path / "manifest.json").write_text("[]")


def damage_metadata(path):
    (path / ".metadata").write_bytes(b"garbage")
    remanifest(path)


@pytest.mark.slow
@pytest.mark.parametrize("damage", [damage_state, damage_info, damage_manifest, damage_metadata])
def test_damaged_latest_checkpoint_falls_back(capsys, tmp_path, dataset, trained, damage):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    first, latest = ckpt.list_checkpoints(run)
    damage(latest)
    code, out, err = cli(capsys, *resume_args(dataset, run))
    assert code == 0, (out, err)
    assert "Traceback" not in err
    assert f"skipping checkpoint {latest}" in err and len(err.strip().splitlines()) == 1, err
    assert f"resuming from {first} (step 1)" in out
    # every checkpoint damaged: one line, nothing touched
    for path in ckpt.list_checkpoints(run):
        damage(path)
    before = snapshot(run)
    assert_user_error(capsys, resume_args(dataset, run, 5), "corrupt")
    assert snapshot(run) == before


def test_metrics_cut_short_last_line_is_dropped(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    truncate_after(path, 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "damaged last line" in err


def test_metrics_damaged_middle_line_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    text = '{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n'
    path.write_text(text)
    with pytest.raises(LowbitError, match="metrics.jsonl: line 2"):
        truncate_after(path, 2)
    assert path.read_text() == text


@pytest.mark.slow
def test_resume_after_a_crash_mid_metrics_line(capsys, tmp_path, dataset, trained):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "lo')
    code, out, err = cli(capsys, *resume_args(dataset, run))
    assert code == 0, (out, err)
    assert "damaged last line" in err and "Traceback" not in err
    assert max(r["step"] for r in read_metrics(run)) == 3
    # damage in the middle: one line naming the file
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert_user_error(capsys, resume_args(dataset, run, 4), "metrics.jsonl")
