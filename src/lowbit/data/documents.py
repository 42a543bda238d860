"""Turn input paths (files, directories) into a deterministic stream of text documents.

A file may be compressed (`.gz`, `.bz2`, `.xz`, `.zst`): the suffix before the compression suffix says what it
holds (`corpus.jsonl.gz` is JSON lines). Whatever the kind, the decoded text is checked: a corrupt archive, or one
that decodes to replacement characters (binary data, a wrong codec), is refused on one line rather than tokenized.
"""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import json
import lzma
import os
import re
import zlib
from pathlib import Path
from typing import IO, Iterable, Iterator

from lowbit.errors import LowbitError

# Suffixes picked up when recursing a directory; explicitly named files are read whatever their suffix.
TEXT_SUFFIXES = frozenset(
    ".txt .text .md .markdown .rst .tex .org .html .htm .xml .json .csv .tsv .toml .yaml .yml .ini .cfg "
    ".py .pyi .c .h .cc .cpp .hpp .cu .rs .go .java .kt .scala .js .ts .jsx .tsx .rb .php .lua .sh .sql".split()
)
STRUCTURED_SUFFIXES = frozenset({".jsonl", ".parquet"})
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst")
_SHARD_NAME = re.compile(r"(train|val)_\d{5}\.bin")  # as shards.ShardWriter names them
# Invalid UTF-8 sequences a text file may hold (each replaced by U+FFFD): 16, or 1% of its bytes if more.
_MAX_BAD, _MAX_BAD_SHARE = 16, 0.01
_EARLY_CHECK_BYTES = 1 << 20  # a JSON-lines file is refused as soon as its first MiB fails that check


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
            kind, _ = kind_of(Path(name))
            if not name.startswith(".") and (kind in TEXT_SUFFIXES or kind in STRUCTURED_SUFFIXES):
                yield here / name


def kind_of(f: Path) -> tuple[str, str]:
    """(what the file holds, its compression): "a.jsonl.gz" -> (".jsonl", ".gz"); "a.txt" -> (".txt", "")."""
    suffix = f.suffix.lower()
    if suffix in COMPRESSED_SUFFIXES:
        return Path(f.stem).suffix.lower(), suffix
    return suffix, ""


def open_binary(f: Path) -> IO[bytes]:
    """The file's bytes, decompressed as its suffix says; zstd needs the optional `zstandard` package."""
    _, compression = kind_of(f)
    if compression == ".gz":
        return gzip.open(f, "rb")
    if compression == ".bz2":
        return bz2.open(f, "rb")
    if compression == ".xz":
        return lzma.open(f, "rb")
    if compression == ".zst":
        try:
            import zstandard  # optional dependency: only needed for .zst inputs
        except ImportError:
            raise LowbitError(f"reading {f} needs zstandard: pip install zstandard") from None
        # Buffered: zstandard's reader has no readline, which JSON lines are read with.
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(f, "rb"), closefd=True))
    return open(f, "rb")


# What the decompressors raise on a damaged or truncated stream (zstandard's ZstdError is a plain Exception).
_CORRUPT = (EOFError, OSError, zlib.error, lzma.LZMAError, ValueError)


def _corrupt(f: Path, e: Exception) -> LowbitError:
    _, compression = kind_of(f)
    what = f"a readable {compression} file (corrupt or truncated?)" if compression else "readable"
    return LowbitError(f"{f} is not {what}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


@contextlib.contextmanager
def _damaged_as_error(f: Path):
    """A decompressor's failure inside the block as one line naming `f` (a damaged input), else as raised."""
    try:
        yield
    except LowbitError:
        raise
    except Exception as e:  # noqa: BLE001 - any decompressor failure is a damaged input
        if not kind_of(f)[1] and not isinstance(e, _CORRUPT):
            raise
        raise _corrupt(f, e) from None


def _read_bytes(f: Path) -> bytes:
    with _damaged_as_error(f), open_binary(f) as fh:
        return fh.read()


def _too_many_bad(bad: int, size: int) -> bool:
    return bad > max(_MAX_BAD, _MAX_BAD_SHARE * size)


def _not_text(f: Path) -> LowbitError:
    compressed = kind_of(f)[1]
    hint = "does not decompress to UTF-8 text (binary?)" if compressed else "is not UTF-8 text (binary? " \
        "compressed without a .gz/.bz2/.xz/.zst suffix?)"
    return LowbitError(f"{f} {hint}; remove it from the data or convert it")


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
    data = _read_bytes(f)
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())  # less the U+FFFD that were in the file
    if b"\0" in data or _too_many_bad(bad, len(data)):
        raise _not_text(f)
    return text.replace("\r\n", "\n").replace("\r", "\n")  # newlines as read_text() gave them


def read_documents(
    inputs: Iterable[str | Path], field: str = "text", column: str = "text"
) -> Iterator[str]:
    """Yield documents: one per .jsonl line (its `field`), one per .parquet row (its `column`),
    one per other file (UTF-8, a few undecodable bytes replaced, binary refused); any of them compressed."""
    for f in list_files(inputs):
        suffix, _ = kind_of(f)
        if suffix == ".jsonl":
            yield from _read_jsonl(f, field)
        elif suffix == ".parquet":
            yield from _read_parquet(f, column)
        else:
            yield _read_text(f)


def _read_jsonl(f: Path, field: str) -> Iterator[str]:
    """Records of a JSON-lines file. Its undecodable bytes are counted as a text file's are: a file that is
    mostly replacement characters is refused (checked as it is read and at its end; prepare then discards
    what it had written)."""
    bad = size = 0
    for lineno, raw in _binary_lines(f):
        line = raw.decode("utf-8", errors="replace")
        bad += line.count("\ufffd") - raw.count("\ufffd".encode())
        size += len(raw)
        if size >= _EARLY_CHECK_BYTES and _too_many_bad(bad, size):
            raise _not_text(f)
        value = _record_text(f, lineno, line, field) if line.strip() else None
        if value is not None:
            yield value
    if _too_many_bad(bad, size):
        raise _not_text(f)


def _binary_lines(f: Path) -> Iterator[tuple[int, bytes]]:
    with _damaged_as_error(f), open_binary(f) as fh:
        yield from enumerate(fh, 1)


def _record_text(f: Path, lineno: int, line: str, field: str) -> str | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise LowbitError(f"{f}:{lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(record, dict) or field not in record:
        raise LowbitError(f"{f}:{lineno}: no field {field!r} (set data.field / --field)")
    value = record[field]
    if value is not None and not isinstance(value, str):
        raise LowbitError(f"{f}:{lineno}: field {field!r} is {type(value).__name__}, not a string")
    return value


def _read_parquet(f: Path, column: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq  # optional dependency: only needed for .parquet inputs
    except ImportError:
        raise LowbitError(f"reading {f} needs pyarrow: pip install pyarrow") from None
    source = io.BytesIO(_read_bytes(f)) if kind_of(f)[1] else f  # parquet seeks: a compressed one is read whole
    try:
        pf = pq.ParquetFile(source)
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
