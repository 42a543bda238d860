"""Where a run reports: RUN_DIR/metrics.jsonl (one JSON object per line), a progress line on stdout, optional
TensorBoard event files, and loss.png at the end."""

from __future__ import annotations

import json
import os
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
    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.file = open(self.path, "a")
        self.tb = None
        if tensorboard:
            check_tensorboard()
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(("val/" if k.startswith("val") else "train/") + k, v, record["step"])

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after `step` (a rollback redoes them); keeps logging to the file."""
        self.file.close()
        truncate_after(self.path, step)
        self.file = open(self.path, "a")

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


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
