"""A fuzzer that keeps the failure cases closed: random config values, and random damage to a prepared dataset, a
run's checkpoints and its metrics, each met by a clean run (exit 0) or one line naming what is wrong (exit 2),
never a traceback. Seeded, so a failure reproduces."""

import dataclasses
import random
import shutil

import pytest
from conftest import SMALL, cli

from lowbit.data.cache import default_dataset
from lowbit.errors import LowbitError
from lowbit.train.config import SECTIONS, Config
from lowbit.train.plan import load_config

JUNK = ["-1", "0", "1e99", "nan", "inf", "abc", "", "3.5", "true", "-0", "999999999", "fp3", "\x00", "a,b"]


def _keys() -> list[str]:
    cfg = Config()
    return ["recipe"] + [f"{s}.{f.name}" for s in SECTIONS for f in dataclasses.fields(getattr(cfg, s))]


@pytest.mark.parametrize("seed", range(400))
def test_a_random_config_value_is_accepted_or_refused_on_one_line(seed, tmp_path):
    rng = random.Random(seed)
    args = []
    for _ in range(rng.randint(1, 3)):
        args += [f"--{rng.choice(_keys())}", rng.choice(JUNK)]
    try:
        load_config(None, [*args, "--run.dir", str(tmp_path / "run")])
    except LowbitError as e:
        assert "\n" not in str(e) and str(e), (args, str(e))


def _damage(path, rng) -> str:
    """One random kind of damage to `path` (a file): deleted, emptied, cut short, bytes flipped, or not JSON."""
    data = path.read_bytes()
    kind = rng.choice(["delete", "empty", "truncate", "flip", "garbage"])
    if kind == "delete":
        path.unlink()
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncate":
        path.write_bytes(data[: rng.randrange(max(1, len(data)))])
    elif kind == "flip":
        b = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            if b:
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(b))
    else:
        path.write_bytes(b"[]")
    return f"{kind} {path.name}"


def _assert_clean(code, out, err, what):
    assert "Traceback" not in err and code in (0, 2), (what, code, err[-2000:])
    if code == 2:
        errors = [line for line in err.strip().splitlines() if line.startswith("lowbit: error:")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], (what, err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A prepared dataset and a run of it with two checkpoints, to copy and damage."""
    root = tmp_path_factory.mktemp("fuzz")
    shutil.copytree(default_dataset(), root / "data")
    args = [*SMALL, "--data.path", root / "data", "--train.steps", "4", "--checkpoint.every", "2"]
    assert main_ok(args, root / "run")
    return root, args


def main_ok(args, run_dir) -> bool:
    from lowbit.cli import main

    return main(["train", *map(str, args), "--run.dir", str(run_dir)]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(12))
def test_random_damage_to_data_is_met_by_one_line(seed, trained, tmp_path, capsys):
    root, args = trained
    rng = random.Random(seed)
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    what = _damage(rng.choice(sorted(p for p in data.iterdir() if p.is_file())), rng)
    args = [a if a != root / "data" else data for a in args]
    _assert_clean(*cli(capsys, "train", *args, "--train.steps", "2", "--run.dir", tmp_path / "run"), what)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(16))
def test_random_damage_to_a_run_is_met_by_a_resume_or_one_line(seed, trained, tmp_path, capsys):
    root, args = trained
    rng = random.Random(seed)
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    files = sorted(p for p in run.rglob("*") if p.is_file() and (p.parent.name.startswith("step_") or
                                                                  p.name == "metrics.jsonl"))
    what = "; ".join(_damage(p, rng) for p in rng.sample(files, rng.randint(1, 2)))
    _assert_clean(*cli(capsys, "train", *args, "--train.steps", "6", "--run.dir", run, "--run.resume"), what)
