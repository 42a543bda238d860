"""Where a run reports: RUN_DIR/metrics.jsonl (one JSON object per line), a progress line on stdout, optional
trackers (TensorBoard event files, a Weights & Biases run), and loss.png at the end.

The trackers get every number of every record, nested ones flattened into tags (`numerics/<layer>/<operand>/
<stat>`, `optim_states/<moment>/<stat>`), and the memory report (`memory/<scope>/bytes_per_param/<category>`), which
metrics.jsonl leaves to memory.json."""

from __future__ import annotations

import json
import os
import secrets
import sys
from pathlib import Path

from lowbit.errors import LowbitError

# Dense BF16 tensor-core peaks (FLOP/s) for MFU. Matched against torch.cuda.get_device_name().
GPU_PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
                 "B200": 2250e12}


def gpu_peak_flops(device) -> float | None:
    import torch

    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in GPU_PEAK_BF16.items():
        if key in name:
            return peak
    return None


def check_tensorboard() -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        raise LowbitError("run.tensorboard: the tensorboard package is not installed (pip install tensorboard)") \
            from None


def check_wandb() -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise LowbitError("run.wandb: the wandb package is not installed (pip install wandb)") from None


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a (nested) record as {tag: value}: top-level ones under train/ or val/, nested ones under
    their path of keys. Strings and nulls are left out."""
    out = {}
    for k, v in record.items():
        if k == "step" and not prefix:
            continue
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and v is not None:
            tag = f"{prefix}{k}" if prefix else ("val/" if k.startswith("val") else "train/") + k
            out[tag] = float(v)
    return out


def _record(line: str) -> dict | None:
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) else None


def truncate_after(path: Path, step: int) -> None:
    """Drop lines of steps after `step` (a resumed run redoes them), atomically."""
    if not path.exists():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = [_record(line) for line in lines]
    if records and records[-1] is None:  # a crash mid-write: its last line is cut short
        warn(f"{path}: dropping its damaged last line (cut short by a crash?)")
        lines, records = lines[:-1], records[:-1]
    if None in records:
        raise LowbitError(f"{path}: line {records.index(None) + 1} is not a JSON record (damaged; repair or remove "
                          f"that line)")
    kept = [line for line, r in zip(lines, records) if r.get("step", 0) <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class Metrics:
    def __init__(self, run_dir: Path, tensorboard: bool, wandb: dict | None = None):
        """`wandb`: None, or the W&B run's settings: {"project", "config"}."""
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "a")
        self.tb = self.wandb = None
        if tensorboard:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb is not None:
            self.wandb = _start_wandb(run_dir, **wandb)

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.track(record)

    def track(self, record: dict) -> None:
        """The record's numbers to the trackers only (not metrics.jsonl)."""
        scalars = flatten(record)
        if not scalars:
            return
        if self.tb is not None:
            for tag, v in scalars.items():
                self.tb.add_scalar(tag, v, record["step"])
        if self.wandb is not None:
            # logged against "step" as a value, not W&B's own step counter: resumed and rolled-back runs log
            # earlier steps again, which W&B's counter would drop
            self.wandb.log({"step": record["step"], **scalars})

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after `step` (a rollback redoes them); keeps logging to the file."""
        self.file.close()
        truncate_after(self.path, step)
        self.file = open(self.path, "a")

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def _start_wandb(run_dir: Path, project: str, config: dict):
    """A W&B run whose files live in RUN_DIR/wandb; a resumed lowbit run continues the same W&B run (its id is
    kept in RUN_DIR/wandb/run_id). Offline or online as W&B's own settings say (WANDB_MODE)."""
    check_wandb()
    import wandb

    (run_dir / "wandb").mkdir(exist_ok=True)
    id_file = run_dir / "wandb" / "run_id"
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    try:
        run = wandb.init(project=project, name=run_dir.resolve().name, id=run_id, resume="allow",
                         dir=str(run_dir), config=config,
                         settings=wandb.Settings(silent=True, console="off"))  # stdout stays lowbit's
    except Exception as e:  # noqa: BLE001 - login, network or settings: the user's to fix, said on one line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LowbitError(f"run.wandb: W&B did not start ({first}); WANDB_MODE=offline logs without an account") \
            from None
    run.define_metric("*", step_metric="step")
    return run


def progress_line(step: int, steps: int, loss: float, lr: float, tokens_per_s: float, mfu: float | None,
                  eta_s: float, peak_gib: float | None = None) -> str:
    mfu_s = f" | mfu {100 * mfu:5.1f}%" if mfu is not None else ""
    peak_s = f" | peak {peak_gib:.1f} GiB" if peak_gib is not None else ""
    return (f"step {step:>6}/{steps} | loss {loss:7.4f} | lr {lr:.2e} | {tokens_per_s:9.0f} tok/s{mfu_s}{peak_s}"
            f" | eta {_hms(eta_s)}")


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def plot_losses(metrics_path: Path, out_png: Path) -> None:
    """Training and validation loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = [], []
    for line in metrics_path.read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            train.append((r["step"], r["loss"]))
        if "val_loss" in r:
            val.append((r["step"], r["val_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def warn(msg: str) -> None:
    print(f"lowbit: {msg}", file=sys.stderr)
