import hashlib
import json
from pathlib import Path

import pytest
import torch

from lowbit.cli import main


@pytest.fixture(scope="session", autouse=True)
def _cache(tmp_path_factory):
    """One dataset cache for the whole session, so the built-in corpus is prepared once, not in ~/.cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("LOWBIT_CACHE", str(tmp_path_factory.mktemp("lowbit-cache")))
    yield
    mp.undo()


# A model small enough that a few steps take a second on a 2-core CPU.
SMALL = ["--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "2", "--model.n_kv_heads", "1",
         "--data.seq_len", "32", "--train.batch_size", "4", "--train.warmup_steps", "3", "--train.eval_every", "4",
         "--train.eval_batches", "2", "--train.log_every", "4", "--run.plot", "false"]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(capsys, args, *needles) -> str:
    """`lowbit ARGS` fails as a user error: exit 2, one line on stderr naming each of `needles`, no traceback."""
    code, out, err = cli(capsys, *args)
    assert code == 2, (code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lowbit: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert str(n) in lines[0], lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its sha256: what a refused command must leave as it was."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run_dir) if key in r}


class RaiseInBackward(torch.autograd.Function):
    """Identity forward; a backward that raises (after the gradients of nodes made later have arrived)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("raised in backward")


def build_for_hopper(fn, types: list[str], constants: dict, divisible=(), num_warps: int = 8):
    """A Triton kernel built through ptxas for sm90 without a GPU: `types` its arguments' (pointers taken 16-byte
    aligned), `constants` its constexprs, `divisible` the integer arguments Triton may take as multiples of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    signature = {**dict(zip(fn.arg_names, types)), **{k: "constexpr" for k in constants}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(types)
             if t.startswith("*") or fn.arg_names[i] in divisible}
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
