"""The result file of a benchmark script that is not `lowbit bench`: its raw rows plus one table in the layout
`lowbit bench --out` writes (meta, tables{key: title, columns, rows, notes}), so that benchmarks/report.py renders
the scripts' tables as it renders bench's. The cells are the strings the table shows: each script formats its own.
"""

from __future__ import annotations

import json
from pathlib import Path


def write(out: str, header: dict, raw: list[dict], key: str, columns: list[tuple[str, str]], rows: list[dict],
          notes: tuple[str, ...] = ()) -> None:
    """columns: (row key, header); the first column's header is the table's title, as in bench's tables."""
    if not out:
        return
    doc = {"header": header, "rows": raw,
           "meta": {k: header[k] for k in ("device", "torch", "date", "command", "commit") if k in header},
           "what": "table", "complete": True,
           "tables": {key: {"title": columns[0][1], "columns": [[k, h, ""] for k, h in columns], "rows": rows,
                            "notes": list(notes)}}}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
