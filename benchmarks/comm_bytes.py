"""Bytes on the wire per training step for each parallel layout, gradient exchange in fp32, bf16 and fp8: the
tiny preset, 4 processes on CPU (gloo), launched with torchrun, 3 steps each; numbers read from metrics.jsonl
(`comm_bytes_grad`: the data-parallel gradient exchange; `comm_bytes_cp`: K/V and their gradients around the
context-parallel ring; `comm_bytes_tp`: tensor/sequence-parallel activations and gradients; `comm_bytes_zero`: the
owners' weight broadcasts). Per rank, every step; rank 0's figures.

    python benchmarks/comm_bytes.py [--nproc 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tables import write  # benchmarks/tables.py: the result file in bench's layout

LAYOUTS = {"dp4": ["--parallel.dp", "4"],
           "dp4 + zero1": ["--parallel.dp", "4", "--parallel.zero", "1"],
           "dp2 x cp2": ["--parallel.dp", "2", "--parallel.cp", "2"],
           "cp4 (ring)": ["--parallel.cp", "4"],
           "dp2 x tp2": ["--parallel.dp", "2", "--parallel.tp", "2"],
           "dp2 x tp2 + sp": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sequence_parallel"],
           "dp2 x tp2 + sp, fp8-tensorwise": ["--parallel.dp", "2", "--parallel.tp", "2",
                                              "--parallel.sequence_parallel", "--recipe", "fp8-tensorwise"],
           "dp2 x pp2": ["--parallel.dp", "2", "--parallel.pp", "2", "--model.tie_embeddings", "false",
                         "--train.micro_batch_size", "2"]}
SYNCS = {"dp4": ("fp32", "bf16", "fp8"), "dp2 x cp2": ("fp32", "bf16", "fp8"), "dp2 x tp2": ("fp32", "bf16", "fp8")}
COMMON = ["--model.n_heads", "4", "--model.n_kv_heads", "2", "--train.steps", "3", "--train.eval_every", "0", "--train.batch_size", "16", "--data.seq_len", "128",
          "--run.plot", "false", "--train.log_every", "1"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--out", default="")
    a = p.parse_args()
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            for sync in SYNCS.get(name, ("fp32",)):
                run = Path(tmp, f"{name}-{sync}".replace(" ", ""))
                cmd = [torchrun, "--nproc-per-node", str(a.nproc), "-m", "lowbit", "train", *COMMON, *layout,
                       "--parallel.grad_sync", sync, "--run.dir", str(run)]
                subprocess.run(cmd, check=True, capture_output=True)
                recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
                last = [r for r in recs if "comm_bytes" in r][-1]
                rows.append({"layout": name, "grad_sync": sync, "grad_bytes": last["comm_bytes_grad"],
                             "cp_bytes": last["comm_bytes_cp"], "tp_bytes": last.get("comm_bytes_tp", 0),
                             "zero_bytes": last.get("comm_bytes_zero", 0), "loss_step3": last["loss"]})
                print(json.dumps(rows[-1]), flush=True)
    header = {"device": f"cpu ({a.nproc} gloo processes)", "torch": torch.__version__,
              "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python"] + sys.argv)}
    print(f"\n{header['device']} | torch {torch.__version__} | {header['date']} | `{header['command']}`\n")
    print("| layout | gradient exchange | gradient bytes | vs bf16 | ring (cp) bytes | tp bytes | ZeRO bytes |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        bf16 = next((x["grad_bytes"] for x in rows if x["layout"] == r["layout"] and x["grad_sync"] == "bf16"),
                    None)
        rel = f"{r['grad_bytes'] / bf16:.3f}x" if bf16 else ""
        print(f"| {r['layout']} | {r['grad_sync']} | {r['grad_bytes']:,} | {rel} | {r['cp_bytes']:,} | "
              f"{r['tp_bytes']:,} | {r['zero_bytes']:,} |")
    write(a.out, header, rows, "bytes", BYTES_COLUMNS, [bytes_row(r, rows) for r in rows])


BYTES_COLUMNS = [("layout", "layout"), ("grad_sync", "gradient exchange"), ("grad", "gradient bytes/step/rank"),
                 ("vs_bf16", "vs bf16"), ("cp", "ring attention bytes/step/rank"), ("tp", "tensor-parallel bytes"),
                 ("zero", "ZeRO-1 bytes")]


def bytes_row(r: dict, rows: list[dict]) -> dict:
    """One line of BENCHMARKS.md's table (benchmarks/tables.py)."""
    bf16 = next((x["grad_bytes"] for x in rows if x["layout"] == r["layout"] and x["grad_sync"] == "bf16"), None)
    return {"layout": r["layout"], "grad_sync": r["grad_sync"], "grad": f"{r['grad_bytes']:,}",
            "vs_bf16": f"{r['grad_bytes'] / bf16:.3f}x" if bf16 else "", "cp": f"{r['cp_bytes']:,}",
            "tp": f"{r['tp_bytes']:,}" if "tp_bytes" in r else "",  # rows written before it counted them
            "zero": f"{r['zero_bytes']:,}" if "zero_bytes" in r else ""}


if __name__ == "__main__":
    main()
