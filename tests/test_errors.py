"""Bad input: one line on stderr naming the key or file, exit status 2, no traceback, nothing overwritten."""

import shutil
from pathlib import Path

import pytest
import torch

from conftest import SMALL, assert_user_error, cli, snapshot
from lowbit.data import default_dataset, train_tokenizer


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A private copy of the prepared built-in corpus that tests may damage."""
    src = default_dataset()
    dst = tmp_path_factory.mktemp("ds") / "data"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("args,needles", [
    (["--model.foo", "3"], ["model.foo"]),
    (["--foo.bar", "1"], ["foo.bar"]),
    (["--train.steps", "abc"], ["train.steps", "int"]),
    (["--train.lr", "fast"], ["train.lr", "float"]),
    (["--run.resume", "maybe"], ["run.resume", "bool"]),
    (["--train.steps", "0"], ["train.steps", "> 0"]),
    (["--train.batch_size", "-4"], ["train.batch_size"]),
    (["--model.dim", "0"], ["model.dim"]),
    (["--data.seq_len", "-1"], ["data.seq_len"]),
    (["--model.n_heads", "0"], ["model.n_heads"]),
    (["--checkpoint.every", "-1"], ["checkpoint.every"]),
    (["--model.dim", "100", "--model.n_heads", "3"], ["model.dim", "model.n_heads"]),
    (["--model.n_heads", "4", "--model.n_kv_heads", "3"], ["model.n_heads", "model.n_kv_heads"]),
    (["--model.preset", "65b"], ["model.preset"]),
    (["--recipe", "fp3"], ["recipe"]),
    (["--train.dtype", "fp16"], ["train.dtype"]),
    (["--parallel.cp_layout", "ring"], ["parallel.cp_layout", "'ring' is not one of zigzag, plain"]),
    (["--parallel.cp_kv_dtype", "bf16"], ["parallel.cp_kv_dtype", "'bf16' is not one of auto, fp8"]),
    (["--parallel.cp_kv_dtype", "fp8"], ["parallel.cp_kv_dtype", "parallel.cp > 1"]),
    (["--train.batch_size", "6", "--train.micro_batch_size", "4"], ["train.micro_batch_size"]),
    (["--data.val_fraction", "1.5"], ["data.val_fraction"]),
    (["--train.stop_at", "50", "--train.steps", "10"], ["train.stop_at"]),
    (["--recipe", "fp8-tensorwise", "--numerics.dge_k", "2"], ["numerics.dge_k", "no DGE"]),
    (["--recipe", "fp4", "--numerics.dge_clamp", "0"], ["numerics.dge_clamp", "> 0"]),
    (["--recipe", "fp8-tensorwise", "--numerics.occ_products", "fp8"], ["numerics.occ_products", "no OCC"]),
    (["--recipe", "fp4", "--numerics.occ_products", "fp4"], ["numerics.occ_products", "'fp4' is not one of"]),
    (["--recipe", "bf16", "--numerics.fprop_accum", "precise"], ["numerics.fprop_accum", "no low-precision"]),
    (["--numerics.fprop_accum", "slow"], ["numerics.fprop_accum", "'slow' is not one of"]),
    (["--recipe", "fp8-rowwise", "--numerics.scaling", "delayed"], ["numerics.scaling", "one scale per tensor"]),
    (["--recipe", "fp8-tensorwise", "--numerics.interval", "4"], ["numerics.interval", "no delayed scaling"]),
    (["--recipe", "bf16", "--numerics.margin", "1"], ["numerics.margin", "no low-precision linears"]),
    (["--recipe", "fp8-delayed", "--numerics.margin", "-1"], ["numerics.margin", ">= 0"]),
    (["--numerics.scaling", "late"], ["numerics.scaling", "'late' is not one of (empty), current, delayed"]),
    (["--model.sdpa_backend", "fast"], ["model.sdpa_backend", "'fast' is not one of auto, cudnn"]),
    (["--run.device", "cpu", "--model.sdpa_backend", "cudnn"], ["model.sdpa_backend", "CUDA only"]),
    (["--model.attention", "performer", "--model.sdpa_backend", "flash"], ["model.sdpa_backend", "no SDPA kernel"]),
    (["stray"], ["stray"]),
])
def test_bad_config_values(capsys, tmp_path, args, needles):
    run = tmp_path / "run"
    if args[0] == "stray":
        args = ["--train.steps", "2", "stray"]
    assert_user_error(capsys, ["train", *args, "--run.dir", run], *needles)
    assert not run.exists()


def test_bad_toml_files(capsys, tmp_path):
    bad_type = tmp_path / "bad.toml"
    bad_type.write_text('[train]\nsteps = "ten"\n')
    assert_user_error(capsys, ["train", bad_type], "train.steps")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[model]\nwidth = 3\n")
    assert_user_error(capsys, ["train", unknown], "model.width")
    broken = tmp_path / "broken.toml"
    broken.write_text("[model\n")
    assert_user_error(capsys, ["train", broken], str(broken))
    assert_user_error(capsys, ["train", tmp_path / "missing.toml"], "missing.toml")


def test_shipped_configs_are_valid():
    from lowbit.train.plan import load_config

    configs = sorted(Path(__file__).parent.parent.glob("configs/*.toml"))
    assert {p.stem for p in configs} >= {"tiny", "125m", "350m", "1b", "7b", "13b"}
    for p in configs:
        assert load_config(str(p), []).model.preset == p.stem


def test_missing_data_path(capsys, tmp_path):
    assert_user_error(capsys, ["train", *SMALL, "--data.path", tmp_path / "nope", "--run.dir", tmp_path / "r"],
                      "nope")
    assert not (tmp_path / "r").exists()


def test_empty_corpus(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    assert_user_error(capsys, ["train", *SMALL, "--data.path", tmp_path / "empty", "--run.dir", tmp_path / "r"],
                      "empty corpus")


def test_shard_size_and_checksum_mismatch(capsys, tmp_path, dataset):
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    shard = sorted(bad.glob("train_*.bin"))[0]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert_user_error(capsys, ["train", *SMALL, "--data.path", bad, "--run.dir", tmp_path / "r"], shard.name,
                      "checksum")
    shard.write_bytes(bytes(data[:-6]))
    assert_user_error(capsys, ["train", *SMALL, "--data.path", bad, "--run.dir", tmp_path / "r"], shard.name, "size")
    assert not (tmp_path / "r").exists()


def test_tokenizer_differs_from_shards(capsys, tmp_path, dataset):
    other = train_tokenizer(["completely different text " * 50, "another document"], vocab_size=300)
    other.save(str(tmp_path / "tokenizer.json"))
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--data.tokenizer", tmp_path / "tokenizer.json",
                               "--run.dir", tmp_path / "r"], "tokenizer")


def test_vocab_larger_than_embedding(capsys, tmp_path, dataset):
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--model.vocab_size", "1000",
                               "--run.dir", tmp_path / "r"], "model.vocab_size")


def test_run_dir_not_writable(capsys, tmp_path, dataset):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    # A path under a regular file cannot be created, even by root (chmod would not stop root).
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--run.dir", blocker / "run"], "run.dir")
    assert blocker.read_text() == "not a directory"


def test_run_dir_with_undecodable_bytes_is_refused_before_it_is_made(capsys, tmp_path, dataset):
    run = str(tmp_path / "run") + "\udcff"  # what Python makes of a non-UTF-8 byte in argv
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--run.dir", run], "not valid Unicode")
    assert list(tmp_path.iterdir()) == []


def test_resume_missing_or_corrupt(capsys, tmp_path, dataset):
    run = tmp_path / "run"
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--run.dir", run, "--run.resume"],
                      "no checkpoint")
    assert cli(capsys, "train", *SMALL, "--data.path", dataset, "--train.steps", "2", "--run.dir", run)[0] == 0
    (next((run / "checkpoints").iterdir()) / "state.pt").write_bytes(b"garbage")
    before = snapshot(run)
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--train.steps", "4", "--run.dir", run,
                               "--run.resume"], "corrupt")
    assert snapshot(run) == before


def test_existing_run_is_not_overwritten(capsys, tmp_path, dataset):
    run = tmp_path / "run"
    assert cli(capsys, "train", *SMALL, "--data.path", dataset, "--train.steps", "2", "--run.dir", run)[0] == 0
    before = snapshot(run)
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--train.steps", "2", "--run.dir", run],
                      "already holds a run")
    # A resume whose config no longer fits the checkpoint fails before touching anything either.
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--model.dim", "128", "--run.dir", run,
                               "--run.resume"], "model shape")
    assert snapshot(run) == before


@pytest.mark.slow
def test_non_finite_steps_are_skipped_then_rolled_back_then_stop(capsys, tmp_path, dataset):
    run = tmp_path / "run"
    code, out, err = cli(capsys, "train", *SMALL, "--data.path", dataset, "--train.steps", "30",
                         "--checkpoint.every", "1", "--train.lr", "1e30", "--train.warmup_steps", "0",
                         "--train.grad_clip", "0", "--train.rollback_after", "2", "--run.dir", run)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "non-finite" in err and "already rolled back" in err
    assert "update skipped (2 in a row" in out and "rolled back to" in out
    from conftest import read_metrics

    from lowbit.train import checkpoint as ckpt

    records = read_metrics(run)
    good = [r["step"] for r in records if "loss" in r and not r.get("skipped")]
    assert any(r.get("rollback") for r in records)
    names = [p.name for p in ckpt.list_checkpoints(run)]
    assert names and int(names[-1].split("_")[1]) == max(good)  # no checkpoint of a skipped step


def test_a_nan_gradient_is_skipped_counted_and_training_goes_on(capsys, tmp_path, dataset, monkeypatch):
    from conftest import read_metrics

    from lowbit.optim import LowbitAdamW

    real, calls = LowbitAdamW.clip_grad_norm_, []

    def poisoned(self, max_norm):  # step 3's gradients get a NaN, through the FP8 gradient store
        calls.append(1)
        if len(calls) == 3:
            next(iter(self._grads.values())).add(torch.full_like(next(iter(self._grads)), float("nan")))
        return real(self, max_norm)

    monkeypatch.setattr(LowbitAdamW, "clip_grad_norm_", poisoned)
    run = tmp_path / "run"
    code, out, _ = cli(capsys, "train", *SMALL, "--data.path", dataset, "--recipe", "fp8lm-o2", "--train.steps", "6",
                       "--run.dir", run)
    assert code == 0 and "step 3: non-finite gradients, update skipped (1 in a row, 1 in all)" in out
    records = {r["step"]: r for r in read_metrics(run) if "loss" in r}
    assert records[3]["skipped"] and records[6]["skipped_steps"] == 1 and not records[6]["skipped"]
    from lowbit.train import checkpoint as ckpt

    states = ckpt.read_whole(ckpt.list_checkpoints(run)[-1], "optimizer.")
    assert len(states) > 20 and all(torch.isfinite(v.float()).all() for v in states.values())


def test_generate_and_export_bad_input(capsys, tmp_path):
    assert_user_error(capsys, ["generate", tmp_path / "nope"], "nope")
    assert_user_error(capsys, ["export-hf", tmp_path / "nope", tmp_path / "out"], "nope")
    assert_user_error(capsys, ["generate"], "run_dir")
    assert_user_error(capsys, ["frobnicate"], "frobnicate")


@pytest.mark.parametrize("args,needles", [
    (["--train.lr", "nan"], ["train.lr", "finite"]),
    (["--train.grad_clip", "inf"], ["train.grad_clip", "finite"]),
    (["--run.device", "cuda:7"], ["run.device"]),
    (["--run.device", "tpu"], ["run.device"]),
])
def test_bad_values_found_late_are_still_one_line(capsys, tmp_path, dataset, args, needles):
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, *args, "--run.dir", tmp_path / "r"], *needles)
    assert not (tmp_path / "r").exists()


def test_resume_with_another_recipe_or_filters(capsys, tmp_path, dataset):
    run = tmp_path / "run"
    base = [*SMALL, "--data.path", dataset, "--train.steps", "2", "--run.dir", run]
    assert cli(capsys, "train", *base, "--recipe", "fp8-tensorwise")[0] == 0
    before = snapshot(run)
    assert_user_error(capsys, ["train", *base, "--recipe", "fp8-delayed", "--run.resume"], "recipe")
    assert_user_error(capsys, ["train", *base, "--recipe", "fp8-tensorwise", "--numerics.min_dim", "64",
                               "--run.resume"], "does not fit")
    assert snapshot(run) == before
    # a different activation checkpointing policy is not a different model: resume goes on
    assert cli(capsys, "train", *base[:-4], "--train.steps", "3", "--run.dir", run, "--recipe", "fp8-tensorwise",
               "--model.checkpointing", "full", "--run.resume")[0] == 0


def test_export_to_a_file_path(capsys, tmp_path, dataset):
    run = tmp_path / "run"
    assert cli(capsys, "train", *SMALL, "--data.path", dataset, "--train.steps", "1", "--run.dir", run)[0] == 0
    target = tmp_path / "file"
    target.write_text("x")
    assert_user_error(capsys, ["export-hf", run, target], "is a file")


def test_config_toml_round_trips_strings_with_control_characters():
    """A run dir with a tab, newline, quote or backslash writes a config.toml that reads back the same; one with
    undecodable bytes (a lone surrogate) is a one-line error."""
    import tomllib

    from lowbit.errors import LowbitError
    from lowbit.train.config import to_toml
    from lowbit.train.plan import load_config

    odd = 'runs/a\tb\nc"d\\e\x7f\u2028é\U000E0001\U0001F600'
    cfg = load_config(None, ["--run.dir", odd])
    assert tomllib.loads(to_toml(cfg))["run"]["dir"] == odd
    with pytest.raises(LowbitError, match="not valid Unicode"):
        to_toml(load_config(None, ["--run.dir", "runs/\udcff"]))


def test_sdpa_backend_is_refused_under_context_parallelism(monkeypatch):
    import lowbit.distributed.mesh as mesh
    from lowbit.errors import LowbitError
    from lowbit.train.plan import load_config

    monkeypatch.setattr(mesh, "world_size", lambda: 2)  # the layout is checked against the processes running
    cp = ["--parallel.cp", "2", "--data.seq_len", "64"]
    with pytest.raises(LowbitError, match=r"model.sdpa_backend \(math\): context parallelism"):
        load_config(None, [*cp, "--model.sdpa_backend", "math"])
    load_config(None, cp)


@pytest.mark.parametrize("name,make", [("config.toml", "dir"), ("checkpoints", "file")])
def test_run_files_of_the_wrong_kind_are_found_before_training(capsys, tmp_path, dataset, name, make):
    run = tmp_path / "run"
    run.mkdir()
    (run / name).mkdir() if make == "dir" else (run / name).write_text("x")
    assert_user_error(capsys, ["train", *SMALL, "--data.path", dataset, "--run.dir", run], name)
    assert sorted(p.name for p in run.iterdir()) == [name]  # nothing trained, nothing written


@pytest.mark.slow
def test_a_diverged_run_says_so_on_one_line(capsys, tmp_path, dataset):
    args = [*SMALL, "--data.path", dataset, "--train.steps", "20", "--train.lr", "10", "--train.grad_clip", "0"]
    code, _, err = cli(capsys, "train", *args, "--run.dir", tmp_path / "run")
    assert code == 0 and err.count("the run diverged") == 1 and "lower train.lr" in err, err
    code, _, err = cli(capsys, "train", *SMALL, "--data.path", dataset, "--run.dir", tmp_path / "fine")
    assert code == 0 and "diverged" not in err
