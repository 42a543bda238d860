"""Raw text -> tokenizer + token shards + meta.json, written atomically."""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tokenizers import Tokenizer

from lowbit.data.documents import list_files, read_documents
from lowbit.data.shards import FORMAT, ShardWriter, token_dtype
from lowbit.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash, train_tokenizer
from lowbit.errors import LowbitError

SHARD_TOKENS = 2**28
_ENCODE_DOCS = 1024  # documents per encode_batch call ...
_ENCODE_CHARS = 1 << 22  # ... or fewer, so one huge chunk never holds much text in memory


def prepare(
    inputs: Iterable[str | Path],
    out_dir: str | Path,
    *,
    tokenizer: str | Path | None = None,
    vocab_size: int = 8192,
    field: str = "text",
    column: str = "text",
    val_fraction: float = 0.005,
    seed: int = 0,
    eos_token: str = "",
    shard_tokens: int = SHARD_TOKENS,
    overwrite: bool = False,
    sources: list[str] | None = None,
) -> dict:
    """Tokenize `inputs` into `out_dir` and return its meta.json contents.

    Each document gets an independent draw from Generator(seed): with probability `val_fraction` it
    goes to validation. With >= 2 documents and val_fraction > 0 both splits end up non-empty (the
    last document of the full split moves over); a lone document is split by tokens instead, its last
    max(1, val_fraction * n) tokens going to validation, and it counts as a document of both splits.
    val_fraction = 0 means no validation data at all.
    """
    out_dir = Path(out_dir)
    inputs = list(inputs)
    sources = [str(s) for s in (inputs if sources is None else sources)]
    _check_target(out_dir, overwrite)
    if not 0 <= val_fraction < 1:
        raise LowbitError(f"data.val_fraction = {val_fraction!r} must be in [0, 1)")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    files = list_files(inputs)  # once, before our temporary directory can appear among them
    t0 = time.perf_counter()
    how = f"tokenizer {tokenizer}" if tokenizer else f"training a {vocab_size}-token BPE tokenizer"
    # Progress goes to stdout: stderr carries only the one-line error if something is wrong.
    print(f"lowbit prepare: {len(files)} file(s) -> {out_dir} ({how})", flush=True)

    if tokenizer:
        tok = load_tokenizer(tokenizer, eos_token)
    else:
        counted = [0]
        tok = train_tokenizer(_counting(_nonempty(read_documents(files, field, column)), counted), vocab_size,
                              eos_token)
        if counted[0] == 0:
            raise _empty(sources)

    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # debris of a killed run that had our pid
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise LowbitError(f"cannot create {tmp}: {e.strerror}") from None
    try:
        docs = _nonempty(read_documents(files, field, column))
        meta = _write_dataset(tmp, tok, eos_id(tok, eos_token), docs, val_fraction, seed, shard_tokens, sources)
        meta["eos_token"] = tok.id_to_token(meta["eos_id"])
        meta["settings"] = {"field": field, "column": column, "val_fraction": val_fraction, "seed": seed}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    t, d = meta["tokens"], meta["documents"]
    print(
        f"lowbit prepare: {t['train']:,} train + {t['val']:,} val tokens "
        f"({d['train']:,} + {d['val']:,} documents) in {time.perf_counter() - t0:.1f} s -> {out_dir}",
        flush=True,
    )
    return meta


def _write_dataset(tmp: Path, tok: Tokenizer, eos: int, docs: Iterator[str], val_fraction: float, seed: int,
                   shard_tokens: int, sources: list[str]) -> dict:
    dtype = token_dtype(tok.get_vocab_size())
    tok.save(str(tmp / "tokenizer.json"))
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
    # Each split's latest document stays in memory, so _rebalance can still move it.
    pending: dict[str, np.ndarray | None] = {"train": None, "val": None}
    counts = {"train": 0, "val": 0}
    rng = np.random.default_rng(seed)
    try:
        for ids in _encode(tok, docs, eos):
            split = "val" if rng.random() < val_fraction else "train"
            if pending[split] is not None:
                writers[split].write(pending[split])
            pending[split] = ids
            counts[split] += 1
        if counts["train"] + counts["val"] == 0:
            raise _empty(sources)
        if val_fraction > 0:
            _rebalance(pending, counts, val_fraction)
        for split, ids in pending.items():
            if ids is not None:
                writers[split].write(ids)
    finally:
        shards = {s: w.close() for s, w in writers.items()}
    return {
        "format": FORMAT,
        "tokenizer_hash": tokenizer_hash(tok),
        "vocab_size": tok.get_vocab_size(),
        "eos_id": eos,
        "dtype": dtype,
        "splits": shards,
        "tokens": {s: sum(x["tokens"] for x in v) for s, v in shards.items()},
        "documents": counts,
        "sources": sources,
    }


def _rebalance(pending: dict, counts: dict, val_fraction: float) -> None:
    if counts["train"] + counts["val"] == 1:
        ids = pending["train"] if pending["train"] is not None else pending["val"]
        k = max(1, int(len(ids) * val_fraction))  # len >= 2: a non-empty document plus EOS
        pending["train"], pending["val"] = ids[:-k], ids[-k:]
        counts["train"] = counts["val"] = 1
    elif counts["val"] == 0:
        pending["val"], pending["train"] = pending["train"], None
        counts["val"], counts["train"] = 1, counts["train"] - 1
    elif counts["train"] == 0:
        pending["train"], pending["val"] = pending["val"], None
        counts["train"], counts["val"] = 1, counts["val"] - 1


def _encode(tok: Tokenizer, docs: Iterator[str], eos: int) -> Iterator[np.ndarray]:
    """Token ids of each document followed by EOS, encoded in batches (the Rust side runs them in parallel)."""
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast skips offsets; absent before 0.20
    literal = getattr(tok, "encode_special_tokens", None)
    if literal is not None:
        # Text that happens to contain "<|endoftext|>" must not forge a document boundary.
        tok.encode_special_tokens = True
    try:
        chunk: list[str] = []
        chars = 0
        for doc in docs:
            chunk.append(doc)
            chars += len(doc)
            if len(chunk) >= _ENCODE_DOCS or chars >= _ENCODE_CHARS:
                yield from _encode_chunk(encode, chunk, eos)
                chunk, chars = [], 0
        if chunk:
            yield from _encode_chunk(encode, chunk, eos)
    finally:
        if literal is not None:
            tok.encode_special_tokens = literal


def _encode_chunk(encode, chunk: list[str], eos: int) -> Iterator[np.ndarray]:
    for enc in encode(chunk, add_special_tokens=False):
        ids = enc.ids
        ids.append(eos)
        yield np.asarray(ids, dtype=np.int64)


def _nonempty(docs: Iterator[str]) -> Iterator[str]:
    return (d for d in docs if d)


def _counting(docs: Iterator[str], counter: list[int]) -> Iterator[str]:
    for d in docs:
        counter[0] += 1
        yield d


def _empty(sources: list[str]) -> LowbitError:
    shown = ", ".join(sources[:3]) + (f", ... ({len(sources)} inputs)" if len(sources) > 3 else "")
    return LowbitError(f"empty corpus: no non-empty documents in {shown or '(no inputs)'}")


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if (out_dir / "meta.json").is_file():
        if not overwrite:
            raise LowbitError(f"{out_dir} already holds a prepared dataset (meta.json); pass --overwrite to replace it")
    elif out_dir.is_dir() and any(out_dir.iterdir()):
        raise LowbitError(f"{out_dir} exists and is not a prepared dataset; refusing to write into it")
    elif out_dir.exists() and not out_dir.is_dir():
        raise LowbitError(f"{out_dir} exists and is not a directory")


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished dataset into place; an existing dataset is replaced only with `overwrite`."""
    _check_target(out_dir, overwrite)  # again: the directory may have appeared while we worked
    if overwrite and (out_dir / "meta.json").is_file():
        old = out_dir.parent / f".old-{out_dir.name}-{os.getpid()}"
        os.rename(out_dir, old)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            os.rename(old, out_dir)  # put the previous dataset back rather than leave nothing
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.rename(tmp, out_dir)  # replaces an empty directory, fails on a non-empty one
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise LowbitError(f"{out_dir} was created by someone else while preparing; not replacing it") from None
        raise
