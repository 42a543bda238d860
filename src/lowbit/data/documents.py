"""Turn input paths (files, directories) into a deterministic stream of text documents."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Iterable, Iterator

from lowbit.errors import LowbitError

# Suffixes picked up when recursing a directory; explicitly named files are read whatever their suffix.
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .org .html .htm .xml .json .csv .tsv .toml .yaml .yml .ini .cfg "
    ".py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .kt .scala .js .ts .jsx .tsx .rb .php .lua .sh .sql".split()
)
STRUCTURED_SUFFIXES = frozenset({".jsonl", ".parquet"})
_SHARD_NAME = re.compile(r"(train|val)_\d{5}\.bin")  # as shards.ShardWriter names them
# Invalid UTF-8 sequences a text file may hold (each replaced by U+FFFD): 16, or 1% of its bytes if more.
_MAX_BAD, _MAX_BAD_SHARE = 16, 0.01


def list_files(inputs: Iterable[str | Path]) -> list[Path]:
    """Expand inputs to files (each directory's files sorted by path), skipping hidden entries and
    prepared datasets (so `prepare data/ --out data/tok` does not eat its own output on a rerun)."""
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            _check_not_headless(p)
            files.extend(sorted(_walk(p)))
        else:
            raise LowbitError(f"data path not found: {p}")
    return files


def _walk(root: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and not _is_prepared(here / d)
        )
        for d in dirnames:
            _check_not_headless(here / d)
        for name in sorted(filenames):
            suffix = Path(name).suffix.lower()
            if not name.startswith(".") and (suffix in TEXT_SUFFIXES or suffix in STRUCTURED_SUFFIXES):
                yield here / name


def _is_prepared(d: Path) -> bool:
    return (d / "meta.json").is_file() and (d / "tokenizer.json").is_file()


def _check_not_headless(d: Path) -> None:
    """A prepared dataset that lost its meta.json must not be read as raw text (its tokenizer.json would be)."""
    try:
        names = os.listdir(d)
    except OSError:
        return  # unreadable: os.walk skips it
    if "meta.json" not in names and any(_SHARD_NAME.fullmatch(n) for n in names):
        raise LowbitError(f"{d / 'meta.json'} is missing: {d} holds the shards of a prepared dataset; "
                          f"re-run `lowbit prepare`")


def _read_text(f: Path) -> str:
    """A raw text file as UTF-8, a few undecodable bytes replaced; a binary file is refused."""
    data = f.read_bytes()
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())  # less the U+FFFD that were in the file
    if b"\0" in data or bad > max(_MAX_BAD, _MAX_BAD_SHARE * len(data)):
        raise LowbitError(f"{f} is not UTF-8 text (binary?); remove it from the data or convert it")
    return text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as read_text() gave them


def read_documents(
    inputs: Iterable[str | Path], field: str = "text", column: str = "text"
) -> Iterator[str]:
    """Yield documents: one per .jsonl line (its `field`), one per .parquet row (its `column`),
    one per other file (UTF-8, a few undecodable bytes replaced, binary refused)."""
    for f in list_files(inputs):
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            yield from _read_jsonl(f, field)
        elif suffix == ".parquet":
            yield from _read_parquet(f, column)
        else:
            yield _read_text(f)


def _read_jsonl(f: Path, field: str) -> Iterator[str]:
    with open(f, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise LowbitError(f"{f}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or field not in record:
                raise LowbitError(f"{f}:{lineno}: no field {field!r} (set data.field / --field)")
            value = record[field]
            if value is None:
                continue
            if not isinstance(value, str):
                raise LowbitError(f"{f}:{lineno}: field {field!r} is {type(value).__name__}, not a string")
            yield value


def _read_parquet(f: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional dependency: only needed for .parquet inputs
    except ImportError:
        raise LowbitError(f"reading {f} needs pyarrow: pip install pyarrow") from None
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:
        raise LowbitError(f"{f}: not a readable parquet file ({type(e).__name__})") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise LowbitError(f"{f}: no column {column!r} (has {', '.join(names)}; set data.column / --column)")
    for batch in pf.iter_batches(columns=[column], batch_size=4096):
        for value in batch.column(0).to_pylist():
            if value is None:
                continue
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            if not isinstance(value, str):
                raise LowbitError(f"{f}: column {column!r} holds {type(value).__name__}, not strings")
            yield value
