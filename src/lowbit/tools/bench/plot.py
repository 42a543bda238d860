"""The PNG beside a `lowbit bench` JSON report: one panel per table, one bar per row, so that a run's variants
compare at a glance; the step profile's bars are stacked by kind of kernel. `lowbit bench ... --out X.json` writes
X.png; `python -m lowbit.tools.bench.plot X.json ...` redraws the PNGs of earlier reports."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

# the value a table plots: the first of these keys a row has (rows such as the memory floor have only "ms")
VALUES = {"quantize": (("ms_graph", "ms per call (in a CUDA graph; else back to back, else alone)"),
                       ("ms_back_to_back", ""), ("ms", "")),
          "memory": (("activations_mib", "activations saved for backward, MiB"), ("saved_mib", ""))}
DEFAULT = (("ms", "ms (median)"),)
KINDS = ("gemm_ms", "attention_ms", "quant_ms", "fused_quant_ms", "fused_ms", "aten_ms", "idle_ms")  # the profile's
# kernel time by kind (bench.profile.KIND_NAMES); a report written before quant_ms had no such key: drawn as 0


def _value(row: dict, keys) -> float | None:
    """The row's first finite number among `keys`."""
    return next((row[k] for k, _ in keys if isinstance(row.get(k), (int, float)) and math.isfinite(row[k])), None)


def _label(row: dict) -> str:
    variant = str(row.get("variant", "?"))
    return f"{row['shape']}: {variant}" if "shape" in row else variant


def plot(doc: dict, png: str | Path) -> Path | None:
    """Draw `doc` (a bench report as written to JSON) into `png`; None when no table has a row to draw."""
    panels = []
    for name, t in doc.get("tables", {}).items():
        keys = (tuple((k, "") for k in KINDS) if name == "profile" else VALUES.get(name, DEFAULT))
        # an error row is drawn as its message, except in the profile: it has no kernel times to stack
        rows = [r for r in t.get("rows", []) if ("error" in r and name != "profile") or _value(r, keys) is not None]
        if any("error" not in r for r in rows):
            panels.append((name, t, keys, rows))
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [1.2 + 0.32 * len(rows) for *_, rows in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (name, t, keys, rows) in zip(axes[:, 0], panels):
        ys = range(len(rows))  # by position: two rows with the same label keep two bars
        if name == "profile":
            left = [0.0] * len(rows)
            for k in KINDS:
                vals = [float(r.get(k) or 0.0) for r in rows]
                ax.barh(ys, vals, left=left, label=k.removesuffix("_ms"))
                left = [a + b for a, b in zip(left, vals)]
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
            ax.set_xlabel("GPU time per step by kind of kernel, ms (idle: no kernel running)", fontsize=8)
        else:
            vals = [_value(r, keys) or 0.0 for r in rows]
            base = next((v for v, r in zip(vals, rows) if r.get("variant") == "bf16" and "shape" not in r), None)
            ax.barh(ys, vals, color=["#888888" if "bf16" == r.get("variant") else "#1f77b4" for r in rows])
            time = keys[0][0].startswith("ms")
            for y, (v, r) in enumerate(zip(vals, rows)):
                ratio = None if r.get("variant") == "bf16" else r.get("speedup_vs_bf16")  # the GEMM table's
                if base and v and r.get("variant") != "bf16":
                    ratio = base / v if time else v / base
                text = "" if ratio is None else f"  ({ratio:.3f}x bf16" + ("'s speed)" if time else ")")
                ax.text(v, y, f" {r['error'][:80]}" if "error" in r else f" {v:,.4g}{text}", va="center", fontsize=7)
            ax.set_xlabel(keys[0][1], fontsize=8)
            ax.set_xlim(0, max(vals) * 1.35 or 1.0)
        ax.set_yticks(list(ys), [_label(r) for r in rows])
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.set_title(t.get("title", name), fontsize=9)
    m = doc.get("meta", {})
    fig.suptitle(" | ".join(str(m[k]) for k in ("device", "torch", "date") if m.get(k)) + f"\n{m.get('command', '')}",
                 fontsize=7)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(paths: list[str]) -> int:
    for p in paths:
        out = plot(json.loads(Path(p).read_text()), Path(p).with_suffix(".png"))
        print(f"wrote {out}" if out else f"{p}: no rows to plot")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
