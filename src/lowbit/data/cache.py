"""Prepared datasets made on demand: a cache directory keyed by what went into them."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
from pathlib import Path
from typing import Iterable

from lowbit.data.documents import list_files
from lowbit.data.prepare import prepare
from lowbit.data.shards import FORMAT
from lowbit.data.tokenizer import load_tokenizer, tokenizer_hash
from lowbit.errors import LowbitError

# Test suites are most of the stdlib's bulk and are repetitive; leaving them out keeps ~12 MB of source.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
# Held-out share of documents when data.val_fraction is unset. The built-in corpus's files differ a lot (their
# losses spread by about a nat), so the draw decides how far validation sits from training: 3 files left it 1 nat
# below; 10% of the ~730 files (~65 files, ~265K tokens) leaves it within ~0.15 nats on average over draws (by the
# per-file losses of a trained tiny model). A user corpus, usually of many more documents, keeps a smaller share.
BUILTIN_VAL_FRACTION, VAL_FRACTION = 0.1, 0.005


def cache_root(cache_dir: str | Path | None = None) -> Path:
    return Path(cache_dir or os.environ.get("LOWBIT_CACHE") or Path.home() / ".cache" / "lowbit").expanduser()


def builtin_corpus_files() -> list[Path]:
    """The running interpreter's standard library sources: a corpus every machine already has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in _EXCLUDED_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def default_dataset(
    cache_dir: str | Path | None = None,
    vocab_size: int = 4096,
    *,
    tokenizer: str = "",
    val_fraction: float | None = None,
    eos_token: str = "",
) -> Path:
    """The builtin corpus, prepared once per interpreter version and vocabulary, then reused."""
    files = builtin_corpus_files()
    listing = [[str(f), f.stat().st_size] for f in files]
    val_fraction = BUILTIN_VAL_FRACTION if val_fraction is None else val_fraction
    tok_hash, vocab = _tokenizer_key(tokenizer, vocab_size, eos_token)
    key = _key(files=listing, tokenizer=tok_hash, vocab_size=vocab, val_fraction=val_fraction, **_eos(eos_token))
    v = sys.version_info
    out = cache_root(cache_dir) / f"stdlib-py{v.major}{v.minor}-v{vocab}-{key[:10]}"
    return _prepare_once(
        out, files, tokenizer=tokenizer or None, vocab_size=vocab_size, val_fraction=val_fraction,
        eos_token=eos_token, sources=[sysconfig.get_paths()["stdlib"]],
    )


def resolve_dataset(
    path: str,
    *,
    tokenizer: str = "",
    vocab_size: int = 4096,
    field: str = "text",
    column: str = "text",
    val_fraction: float | None = None,
    cache_dir: str | Path | None = None,
    eos_token: str = "",
) -> Path:
    """The trainer's data.path -> a prepared dataset directory: "" is the builtin corpus, a prepared
    directory is used as is, anything else is raw data prepared into (and later reused from) the cache."""
    if not path:
        return default_dataset(cache_dir, vocab_size, tokenizer=tokenizer, val_fraction=val_fraction,
                               eos_token=eos_token)
    p = Path(path).expanduser()
    if (p / "meta.json").is_file():
        return p
    if not p.exists():
        raise LowbitError(f"data path not found: {p}")
    return prepare_cached(
        [p], cache_dir=cache_dir, tokenizer=tokenizer, vocab_size=vocab_size, field=field,
        column=column, val_fraction=val_fraction, eos_token=eos_token,
    )


def prepare_cached(
    inputs: Iterable[str | Path],
    *,
    cache_dir: str | Path | None = None,
    tokenizer: str = "",
    vocab_size: int = 4096,
    field: str = "text",
    column: str = "text",
    val_fraction: float | None = None,
    seed: int = 0,
    eos_token: str = "",
) -> Path:
    """Prepare raw inputs into the cache, keyed by their paths, sizes and mtimes plus every setting."""
    val_fraction = VAL_FRACTION if val_fraction is None else val_fraction
    inputs = [Path(i).expanduser() for i in inputs]
    files = list_files(inputs)
    listing = []
    for f in files:
        st = f.stat()
        listing.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    tok_hash, vocab = _tokenizer_key(tokenizer, vocab_size, eos_token)
    key = _key(files=listing, tokenizer=tok_hash, vocab_size=vocab, field=field, column=column,
               val_fraction=val_fraction, seed=seed, **_eos(eos_token))
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", inputs[0].resolve().name if inputs else "")[:40] or "data"
    out = cache_root(cache_dir) / f"{stem}-v{vocab}-{key[:12]}"
    return _prepare_once(
        out, files, tokenizer=tokenizer or None, vocab_size=vocab_size, field=field, column=column,
        val_fraction=val_fraction, seed=seed, eos_token=eos_token, sources=[str(i.resolve()) for i in inputs],
    )


def _tokenizer_key(tokenizer: str, vocab_size: int, eos_token: str) -> tuple[str | None, int]:
    if not tokenizer:
        return None, vocab_size
    tok = load_tokenizer(tokenizer, eos_token)
    return tokenizer_hash(tok), tok.get_vocab_size()


def _eos(eos_token: str) -> dict:
    """The key part for a named EOS token; none when unset, so the keys of existing caches stay what they were."""
    return {"eos_token": eos_token} if eos_token else {}


def _key(**parts) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **parts}, sort_keys=True).encode()).hexdigest()


def _prepare_once(out: Path, files: list[Path], **kwargs) -> Path:
    if (out / "meta.json").is_file():
        return out

    try:
        prepare(files, out, **kwargs)
    except LowbitError:
        if (out / "meta.json").is_file():  # a concurrent process published the same dataset first
            return out
        raise
    return out
