"""`lowbit inspect RUN_DIR`: the numerics telemetry of a run as a layer x step heatmap per quantity (PNG), and
the worst layers printed."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from lowbit.errors import LowbitError

QUANTITIES = {  # name -> (transform for the colour scale, label, which end is worse)
    "snr_db": (lambda v: v, "quantization SNR (dB)", "low"),
    "underflow_pct": (lambda v: v, "% of non-zeros flushed to zero", "high"),
    "saturated_pct": (lambda v: v, "% saturated at the format's max", "high"),
    "amax": (lambda v: math.log10(v) if v and v > 0 else float("nan"), "log10 amax", None),
    "scale": (lambda v: math.log2(v) if v and v > 0 else float("nan"), "log2 scale", None),
}


def load_telemetry(run_dir: Path) -> tuple[list[int], dict[str, list]]:
    """Steps, and for each 'layer:operand' row a list (per step) of stat dicts."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise LowbitError(f"inspect: {path} not found")
    steps, rows = [], {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            raise LowbitError(f"inspect: {path} has a line that is not JSON") from None
        if "numerics" not in record:
            continue
        steps.append(record["step"])
        for layer, operands in record["numerics"].items():
            for operand, stats in operands.items():
                rows.setdefault(f"{layer}:{operand}", []).append(stats)
    if not steps:
        raise LowbitError(f"inspect: {path} holds no numerics telemetry (a low-precision --recipe and "
                          f"numerics.telemetry_every > 0 record it)")
    return steps, rows


def heatmaps(run_dir: Path, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps, rows = load_telemetry(run_dir)
    names = sorted(rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for q, (f, label, _) in QUANTITIES.items():
        grid = np.array([[f(s.get(q)) if s.get(q) is not None else np.nan for s in rows[n]] +
                         [np.nan] * (len(steps) - len(rows[n])) for n in names], dtype=float)
        fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(steps) + 3), max(4, 0.18 * len(names) + 1.5)))
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis")
        ax.set_yticks(range(len(names)), names, fontsize=6)
        ticks = list(range(0, len(steps), max(1, len(steps) // 12)))
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(f"{run_dir.name}: {label}")
        fig.colorbar(im, ax=ax, label=label)
        fig.tight_layout()
        path = out_dir / f"numerics_{q}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def ranked(rows: dict[str, list], q: str) -> list[tuple[str, float]]:
    """('layer:operand', value of q) at the last telemetry step, worst first (q must have a worse end)."""
    last = [(r, s[-1].get(q)) for r, s in rows.items() if s[-1].get(q) is not None]
    return sorted(last, key=lambda t: t[1], reverse=(QUANTITIES[q][2] == "high"))


def worst(run_dir: Path, n: int = 5) -> list[str]:
    """The n worst rows at the last telemetry step for SNR, underflow and saturation."""
    steps, rows = load_telemetry(run_dir)
    lines = [f"numerics telemetry at step {steps[-1]} ({len(rows)} operands):"]
    for q, (_, label, bad) in QUANTITIES.items():
        if bad is not None:
            lines.append(f"  worst {label}: " + ", ".join(f"{r} {v:.3g}" for r, v in ranked(rows, q)[:n]))
    return lines


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory whose metrics.jsonl holds numerics telemetry")
    p.add_argument("--out", default="", help="where the PNGs go (default: RUN_DIR)")
    p.add_argument("--top", type=int, default=5, help="how many worst operands to print per quantity")


def run(a: argparse.Namespace) -> int:
    run_dir = Path(a.run_dir)
    for line in worst(run_dir, a.top):
        print(line)
    for path in heatmaps(run_dir, Path(a.out) if a.out else run_dir):
        print(path)
    return 0
