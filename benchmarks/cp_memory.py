"""The longest sequence each context-parallel layout should train, predicted from one GPU's measurements
(`ring_attention.py`'s JSON), so that a multi-GPU run checks a prediction instead of searching.

    python benchmarks/cp_memory.py ring_attention.json [--gpus H100=79.1,H200=139.8] [--reserve-gib 3]
                                   [--cps 1,2,4,8] [--write docs/usage.md]

The model: a cp rank holds the whole model (`fixed`: weights, gradients, optimizer states, measured) and the
activations of its L/cp tokens. Per checkpointing policy, the memory of a step above `fixed` is measured at two
sequence lengths on one GPU with the ring's block schedule as the attention core; it is linear in L (nothing
L x L is built or kept), so two points give bytes per token (the slope) and a constant (the intercept). Then

    per-rank peak(L) = fixed + intercept + slope * L / cp        L_max = cp * (M - reserve - fixed - intercept) / slope

with M the card's memory and `reserve` what the allocator does not see (CUDA context, NCCL buffers, fragmentation).
L_max is rounded down to a multiple of 1024. The ring's own buffers (one K/V block in flight, the fp32 merge of
L/cp rows) are inside the slope: the one-GPU schedule allocates the same per simulated rank.
"""

from __future__ import annotations

import argparse
import json
import re

GIB = 2**30
BEGIN, END = "<!-- cp-memory:begin -->", "<!-- cp-memory:end -->"


def fit(rows: list[dict]) -> dict[str, tuple[float, float, float]]:
    """Per policy: (fixed GiB, intercept GiB, slope GiB per token) from its two longest measured lengths."""
    out = {}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["length"], r["peak_above_fixed_gib"], r["fixed_gib"]) for r in rows if r["policy"] == policy)
        if len(pts) < 2:
            continue
        (l1, p1, _), (l2, p2, fixed) = pts[-2], pts[-1]
        slope = (p2 - p1) / (l2 - l1)
        out[policy] = (fixed, p1 - slope * l1, slope)
    return out


def table(report: dict, gpus: dict[str, float], reserve: float, cps: list[int]) -> str:
    fits = fit(report["model"])
    lines = [f"Measured on {report['device']} (torch {report['torch']}), `{report['command']}`; reserve "
             f"{reserve:g} GiB per card. predicted longest sequence (tokens) per GPU and cp degree, one sequence per rank:", "",
             "| policy | fixed GiB | KiB/token | " + " | ".join(f"{g} cp{c}" for g in gpus for c in cps) + " |",
             "|---|---|---|" + "---|" * (len(gpus) * len(cps))]
    for policy, (fixed, icpt, slope) in fits.items():
        cells = []
        for mem in gpus.values():
            for cp in cps:
                room = mem - reserve - fixed - icpt
                if slope <= 0:  # memory did not grow with the sequence: a broken measurement, no prediction
                    cells.append("n/a")
                else:
                    cells.append(f"{int(cp * room / slope) // 1024 * 1024:,}" if room > 0 else "none")
        lines.append(f"| {policy} | {fixed:.1f} | {slope * GIB / 1024:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_between_markers(path: str, text: str) -> None:
    doc = open(path).read()
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"{path} has no {BEGIN} ... {END} section")
    doc = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}\n{END}", doc, flags=re.S)
    open(path, "w").write(doc)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report")
    ap.add_argument("--gpus", default="H100=79.1,H200=139.8", help="NAME=GiB,... the cards' memory")
    ap.add_argument("--reserve-gib", type=float, default=3.0)
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--write", help="a markdown file whose cp-memory section is replaced by the table")
    a = ap.parse_args(argv)
    report = json.load(open(a.report))
    gpus = {k: float(v) for k, v in (x.split("=") for x in a.gpus.split(","))}
    text = table(report, gpus, a.reserve_gib, [int(c) for c in a.cps.split(",")])
    print(text)
    if a.write:
        write_between_markers(a.write, text)


if __name__ == "__main__":
    main()
