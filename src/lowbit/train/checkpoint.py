"""Checkpoints: RUN_DIR/checkpoints/step_NNNNNNNN/ holding

    .metadata, __R_0.distcp   model and optimizer tensors through torch.distributed.checkpoint: every process
                              writes its pieces ("model.<state key>", "optimizer.<parameter>.<state>"), each piece
                              once, with its place in the whole tensor; any layout (one process included) reads
                              back the pieces it holds
    state.pt                  optimizer hyper-parameters, scheduler, gradient-exchange and RNG states: tensors and
                              plain containers, read with weights_only=True
    trainer.json              step, tokens seen, model shape, config, tokenizer hash
    manifest.json             size and sha256 of every file above; written last, so its presence marks a complete
                              write

A checkpoint is written under a temporary name and renamed into place, so a crash mid-write leaves the previous
checkpoints untouched, and a failed write removes its temporary directory; the manifest catches later corruption
(truncated or altered files), and resume also reads the small files and the tensors' index back (`check_contents`).
In a distributed run rank 0 makes and finishes the directory (`begin`, `commit`) and every process writes its
tensors in between (`write_tensors`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lowbit.errors import LowbitError

PREFIX = "step_"
REQUIRED = (".metadata", "state.pt", "trainer.json")
MODEL = "model."
INFO_KEYS = ("step", "tokens_seen", "model_args", "tokenizer_hash")  # what resume reads of trainer.json
STATE_KEYS = ("optimizer", "scheduler", "rng")  # ... and of state.pt


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _one_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException) and e.failures:  # DCP wraps each rank's exception with its traceback
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, OSError) and e.errno:
        return os.strerror(e.errno).lower()
    return f"{type(e).__name__}: {e}".strip().splitlines()[-1][:300]


@contextmanager
def _quiet():
    """DCP's warning that it reads or writes in a single process (what a one-process run means)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


def begin(run_dir: str | Path, step: int, lead: bool = True) -> Path:
    """The temporary directory of checkpoint `step` (made by the lead process, after clearing debris)."""
    root = checkpoint_root(run_dir)
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    if lead:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for debris in root.glob(".tmp-*"):  # left by a process killed mid-write; one writer per run dir
                shutil.rmtree(debris, ignore_errors=True)
            tmp.mkdir()
        except OSError as e:
            raise LowbitError(f"checkpoint: cannot write to {root} ({_one_line(e)})") from None
    return tmp


def write_tensors(tmp: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Every process: its pieces of the model and optimizer (a collective in a distributed run)."""
    final = tmp.parent / tmp.name[len(".tmp-"):]
    try:
        with _quiet():
            dcp.save(tensors, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as e:  # DCP reports any rank's failure on every rank
        raise LowbitError(f"checkpoint: cannot write {final} ({_one_line(e)})") from None


def _write_files(tmp: Path, state: dict, info: dict) -> None:
    torch.save(state, tmp / "state.pt")
    (tmp / "trainer.json").write_text(json.dumps(info, indent=1))


def commit(run_dir: str | Path, step: int, tmp: Path, state: dict, info: dict, keep: int) -> Path:
    """The lead process: the small files and the manifest, then rename into place and keep the newest `keep`."""
    root = checkpoint_root(run_dir)
    final = root / f"{PREFIX}{step:08d}"
    try:
        _write_files(tmp, state, info)
        manifest = {}
        for f in sorted(tmp.iterdir()):
            _fsync(f)  # other processes' files included: same file system
            manifest[f.name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / "manifest.json")
        if final.exists():  # a re-run of the same step after resume: replace the older copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
        shutil.rmtree(tmp, ignore_errors=True)
        raise LowbitError(f"checkpoint: cannot write {final} ({_one_line(e)})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save(run_dir: str | Path, step: int, tensors: dict, state: dict, info: dict, keep: int) -> Path:
    """Write checkpoint `step` from a single process."""
    tmp = begin(run_dir, step)
    try:
        write_tensors(tmp, tensors)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(run_dir, step, tmp, state, info, keep)


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoints, oldest first (temporary directories are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def verify(path: Path) -> None:
    """Raise LowbitError unless every file matches the manifest."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError):
        raise LowbitError(f"checkpoint {path}: missing or unreadable manifest.json") from None
    if not isinstance(manifest, dict) or not all(isinstance(e, dict) and isinstance(e.get("bytes"), int) and
                                                 isinstance(e.get("sha256"), str) for e in manifest.values()):
        raise LowbitError(f"checkpoint {path}: manifest.json is damaged")
    for name in sorted(set(manifest) | set(REQUIRED)):
        f, entry = path / name, manifest.get(name)
        if entry is None or not f.is_file():
            raise LowbitError(f"checkpoint {path}: {name} is missing")
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise LowbitError(f"checkpoint {path}: {name} does not match its manifest (corrupt)")


def find_resumable(run_dir: str | Path) -> Path:
    """The newest checkpoint that verifies and reads back (`check_contents`); damaged newer ones are reported and
    skipped."""
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise LowbitError(f"run.resume: no checkpoint in {checkpoint_root(run_dir)}")
    skipped = []
    for path in reversed(candidates):
        try:
            verify(path)
            check_contents(path)
        except LowbitError as e:
            skipped.append(str(e))
            continue
        for reason in skipped:
            print(f"lowbit: skipping {reason}", file=sys.stderr)
        return path
    raise LowbitError(f"run.resume: every checkpoint in {checkpoint_root(run_dir)} is corrupt ({skipped[0]})")


def check_contents(path: Path) -> None:
    """Raise LowbitError unless state.pt, trainer.json and the tensors' index read back and hold what resume reads:
    damage written before the manifest, which it cannot see."""
    state, info = load_state(path)
    missing = [k for k in INFO_KEYS if not isinstance(info, dict) or k not in info]
    missing += [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise LowbitError(f"checkpoint {path}: {'trainer.json' if missing[0] in INFO_KEYS else 'state.pt'} "
                          f"has no {missing[0]!r} (damaged)")
    _stored(path)


def load_state(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict, dict]:
    """(state, info) of a checkpoint that find_resumable already verified."""
    try:
        state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
        info = json.loads((path / "trainer.json").read_text())
    except Exception as e:  # whatever a damaged pickle raises (UnpicklingError, EOFError, RuntimeError...)
        raise LowbitError(f"checkpoint {path}: cannot be read ({_one_line(e)})") from None
    return state, info


def _stored(path: Path) -> dict:
    try:
        return dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except (Exception, CheckpointException) as e:
        raise LowbitError(f"checkpoint {path}: cannot be read ({_one_line(e)})") from None


def load_tensors(path: Path, tensors: dict[str, torch.Tensor], model_keys: set[str] | None = None) -> None:
    """Fill `tensors` (this process's pieces, as write_tensors takes them) in place from checkpoint `path`.
    `model_keys`: the whole model's state keys; a checkpoint with others does not fit this model."""
    stored = _stored(path)
    problem = None
    for k, t in tensors.items():
        meta = stored.get(k)
        if meta is None or not hasattr(meta, "size"):
            problem = f"it has no {k}"
        elif tuple(meta.size) != tuple(t.shape) or meta.properties.dtype != t.dtype:
            problem = (f"{k} is {meta.properties.dtype} {tuple(meta.size)} there, "
                       f"{t.dtype} {tuple(t.shape)} here")
        if problem:
            break
    if problem is None and model_keys is not None:
        extra = sorted(k[len(MODEL):] for k in stored if k.startswith(MODEL) and k[len(MODEL):] not in model_keys)
        problem = f"it has {extra[0]}, which this model has not" if extra else None
    if problem is not None:
        raise LowbitError(f"run.resume: checkpoint {path} does not fit this model: {problem}")
    try:
        with _quiet():
            dcp.load(tensors, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:
        raise LowbitError(f"checkpoint {path}: cannot be read ({_one_line(e)})") from None


def read_whole(path: Path, prefix: str = MODEL, suffix: str = "") -> dict[str, torch.Tensor]:
    """Whole tensors whose names start with `prefix` (dropped from the keys) and end with `suffix`, read in this
    process alone."""
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in _stored(path).items()
               if k.startswith(prefix) and k.endswith(suffix) and hasattr(m, "size")}
    try:
        with _quiet():
            dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    except (Exception, CheckpointException) as e:
        raise LowbitError(f"checkpoint {path}: cannot be read ({_one_line(e)})") from None
    return {k[len(prefix):]: v for k, v in tensors.items()}


def load_model_weights(path: Path) -> tuple[dict, dict]:
    """(whole model state, info) of a checkpoint latest_for_inference verified: the optimizer state is neither
    needed nor read."""
    try:
        info = json.loads((path / "trainer.json").read_text())
    except (OSError, ValueError) as e:
        raise LowbitError(f"checkpoint {path}: cannot be read ({_one_line(e)})") from None
    state = read_whole(path)
    for key, scale in read_whole(path, "optimizer.", ".weights_scale").items():  # fp16 weights: stored scaled
        name = key[:-len(".weights_scale")]
        state[name] = state[name].float() / scale
    return state, info


def latest_for_inference(run_dir: str | Path) -> Path:
    """A checkpoint dir given directly (verified), or the newest good one of a run dir."""
    p = Path(run_dir)
    if (p / "manifest.json").exists():
        verify(p)
        check_contents(p)
        return p
    if not p.is_dir():
        raise LowbitError(f"run directory not found: {run_dir}")
    return find_resumable(p)
