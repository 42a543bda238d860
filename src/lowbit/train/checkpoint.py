"""Checkpoints: RUN_DIR/checkpoints/step_NNNNNNNN/ holding

    model.safetensors   weights (and any scaling buffers the model carries)
    state.pt            optimizer, scheduler, RNG states: tensors and plain containers, read with weights_only=True
    trainer.json        step, tokens seen, model shape, config, tokenizer hash
    manifest.json       size and sha256 of each file above; written last, so its presence marks a complete write

A checkpoint is written under a temporary name and renamed into place, so a crash mid-write leaves the previous
checkpoints untouched; the manifest catches later corruption (truncated or altered files).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lowbit.errors import LowbitError

PREFIX = "step_"
FILES = ("model.safetensors", "state.pt", "trainer.json")


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


def _write_files(tmp: Path, model_state: dict, state: dict, info: dict) -> None:
    # safetensors wants contiguous tensors that share no storage.
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    torch.save(state, tmp / "state.pt")
    (tmp / "trainer.json").write_text(json.dumps(info, indent=1))


def save(run_dir: str | Path, step: int, model_state: dict, state: dict, info: dict, keep: int) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep`."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    for debris in root.glob(".tmp-*"):  # left by a process killed mid-write; one writer per run dir
        shutil.rmtree(debris, ignore_errors=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    try:
        _write_files(tmp, model_state, state, info)
        manifest = {}
        for name in FILES:
            _fsync(tmp / name)
            manifest[name] = {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / "manifest.json")
        if final.exists():  # a re-run of the same step after resume: replace the older copy
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete-looking checkpoints, oldest first (temporary directories are ignored)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def verify(path: Path) -> None:
    """Raise LowbitError unless every file matches the manifest."""
    manifest_path = path / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        raise LowbitError(f"checkpoint {path}: missing or unreadable manifest.json") from None
    for name in FILES:
        f = path / name
        entry = manifest.get(name)
        if entry is None or not f.is_file():
            raise LowbitError(f"checkpoint {path}: {name} is missing")
        if f.stat().st_size != entry["bytes"] or _sha256(f) != entry["sha256"]:
            raise LowbitError(f"checkpoint {path}: {name} does not match its manifest (corrupt)")


def find_resumable(run_dir: str | Path) -> Path:
    """The newest checkpoint that verifies; corrupt newer ones are reported and skipped."""
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise LowbitError(f"run.resume: no checkpoint in {checkpoint_root(run_dir)}")
    skipped = []
    for path in reversed(candidates):
        try:
            verify(path)
        except LowbitError as e:
            skipped.append(str(e))
            continue
        for reason in skipped:
            print(f"lowbit: skipping {reason}", file=sys.stderr)
        return path
    raise LowbitError(f"run.resume: every checkpoint in {checkpoint_root(run_dir)} is corrupt ({skipped[0]})")


def load(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict, dict, dict]:
    """(model_state, state, info) of a checkpoint that find_resumable already verified."""
    try:
        model_state = load_file(str(path / "model.safetensors"), device=str(map_location))
        state = torch.load(path / "state.pt", map_location=map_location, weights_only=True)
        info = json.loads((path / "trainer.json").read_text())
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LowbitError(f"checkpoint {path}: cannot be read ({type(e).__name__}: {e})".splitlines()[0]) from None
    return model_state, state, info


def load_model_weights(path: Path) -> tuple[dict, dict]:
    """(model_state, info) for inference/export of a checkpoint latest_for_inference verified: the optimizer
    state is neither needed nor read."""
    try:
        return load_file(str(path / "model.safetensors")), json.loads((path / "trainer.json").read_text())
    except (SafetensorError, OSError, ValueError) as e:
        raise LowbitError(f"checkpoint {path}: cannot be read ({type(e).__name__})") from None


def latest_for_inference(run_dir: str | Path) -> Path:
    """A checkpoint dir given directly (verified), or the newest good one of a run dir."""
    p = Path(run_dir)
    if (p / "manifest.json").exists():
        verify(p)
        return p
    if not p.is_dir():
        raise LowbitError(f"run directory not found: {run_dir}")
    return find_resumable(p)
