"""A prepared dataset on disk: meta.json checked, shards verified and memory-mapped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from lowbit.data.shards import DTYPES, FORMAT, file_sha256
from lowbit.data.tokenizer import load_tokenizer, tokenizer_hash
from lowbit.errors import LowbitError

_REQUIRED = ("format", "tokenizer_hash", "vocab_size", "eos_id", "dtype", "splits")


class TokenSplit:
    """One split's shards. Window i of a shard is tokens [i*seq_len, i*seq_len + seq_len + 1):
    consecutive windows overlap by one token so every token is a target once, and none crosses a shard."""

    def __init__(self, shards: list[np.ndarray], name: str = "", path: Path | None = None):
        self.shards = shards
        self.name = name
        self.path = path
        self.num_tokens = int(sum(len(s) for s in shards))
        self._starts: dict[int, np.ndarray] = {}  # seq_len -> first global window index of each shard

    def num_windows(self, seq_len: int) -> int:
        return int(self._window_starts(seq_len)[-1])

    def window(self, i: int, seq_len: int) -> np.ndarray:
        starts = self._window_starts(seq_len)
        if not 0 <= i < starts[-1]:
            raise IndexError(f"window {i} out of range: the {self.name} split has {starts[-1]} of seq_len {seq_len}")
        shard = int(np.searchsorted(starts, i, side="right")) - 1
        begin = (i - int(starts[shard])) * seq_len
        return np.asarray(self.shards[shard][begin : begin + seq_len + 1], dtype=np.int64)

    def _window_starts(self, seq_len: int) -> np.ndarray:
        if seq_len < 1:
            raise LowbitError(f"data.seq_len = {seq_len} must be >= 1")
        if seq_len not in self._starts:
            counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
            self._starts[seq_len] = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        return self._starts[seq_len]

    def __repr__(self) -> str:
        return f"TokenSplit({self.name!r}, {len(self.shards)} shards, {self.num_tokens} tokens)"


class TokenDataset:
    """A directory written by `lowbit prepare`. With `tokenizer`, checks it is the one the shards used."""

    def __init__(self, path: str | Path, tokenizer: str = "", verify: bool = True):
        self.path = Path(path)
        self.meta = _read_meta(self.path)
        self.vocab_size = int(self.meta["vocab_size"])
        self.eos_id = int(self.meta["eos_id"])
        self.eos_token = str(self.meta.get("eos_token") or "")  # the token prepare named, if it recorded it
        self.tokenizer_path = self.path / "tokenizer.json"
        self._check_own_tokenizer()
        if tokenizer:
            h = tokenizer_hash(load_tokenizer(tokenizer, self.eos_token))
            if h != self.meta["tokenizer_hash"]:
                raise LowbitError(
                    f"tokenizer {tokenizer} (hash {h[:12]}) differs from the one the shards in {self.path} "
                    f"were made with ({self.meta['tokenizer_hash'][:12]})"
                )
        dtype = DTYPES[self.meta["dtype"]]
        self._splits = {
            name: TokenSplit([self._open_shard(e, dtype, verify) for e in entries], name, self.path)
            for name, entries in self.meta["splits"].items()
        }

    def split(self, name: str) -> TokenSplit:
        if name not in self._splits:
            raise LowbitError(f"{self.path / 'meta.json'} has no split {name!r} (has {', '.join(self._splits)})")
        return self._splits[name]

    def load_tokenizer(self) -> Tokenizer:
        return load_tokenizer(self.tokenizer_path, self.eos_token)

    def _check_own_tokenizer(self) -> None:
        """tokenizer.json is present, loads, and its ids fit meta.json's vocab_size."""
        if not self.tokenizer_path.is_file():
            raise LowbitError(f"{self.tokenizer_path} is missing; re-run `lowbit prepare`")
        try:
            n = load_tokenizer(self.tokenizer_path, self.eos_token).get_vocab_size()
        except LowbitError as e:
            raise LowbitError(f"{e}; re-run `lowbit prepare`") from None
        if self.vocab_size < n or not 0 <= self.eos_id < self.vocab_size:
            raise LowbitError(f"{self.path / 'meta.json'}: vocab_size {self.vocab_size} / eos_id {self.eos_id} "
                              f"do not fit the tokenizer's {n} ids; re-run `lowbit prepare`")

    def _open_shard(self, entry: dict, dtype: np.dtype, verify: bool) -> np.ndarray:
        try:
            name, tokens, digest = entry["file"], int(entry["tokens"]), entry["sha256"]
        except (KeyError, TypeError, ValueError):
            raise LowbitError(f"{self.path / 'meta.json'}: malformed shard entry {entry!r}") from None
        if Path(name).name != name:  # shards live beside meta.json, never elsewhere
            raise LowbitError(f"{self.path / 'meta.json'}: shard file {name!r} is not a plain file name")
        f = self.path / name
        if not f.is_file():
            raise LowbitError(f"shard {f} is missing")
        size, expected = f.stat().st_size, tokens * dtype.itemsize
        if size != expected:
            raise LowbitError(f"shard {f}: size {size} bytes, meta.json says {expected} ({tokens} tokens)")
        if verify and file_sha256(f) != digest:
            raise LowbitError(f"shard {f}: checksum mismatch (sha256 differs from meta.json); re-run `lowbit prepare`")
        if tokens == 0:
            return np.empty(0, dtype)  # mmap cannot map an empty file
        shard = np.memmap(f, dtype=dtype, mode="r", shape=(tokens,))
        top = int(shard.max()) if verify else 0  # the checksum has just read the file: cheap
        if top >= self.vocab_size:
            raise LowbitError(f"shard {f}: token id {top} >= vocab_size {self.vocab_size} of meta.json; "
                              f"re-run `lowbit prepare`")
        return shard


def _read_meta(path: Path) -> dict:
    f = path / "meta.json"
    if not f.is_file():
        raise LowbitError(f"not a prepared dataset: {path} (no meta.json); run `lowbit prepare`")
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LowbitError(f"{f} is not valid JSON: {e}") from None
    if not isinstance(meta, dict):
        raise LowbitError(f"{f} is not a JSON object")
    for key in _REQUIRED:
        if key not in meta:
            raise LowbitError(f"{f} lacks key {key!r}")
    if meta["format"] != FORMAT:
        raise LowbitError(f"{f}: format {meta['format']!r}, expected {FORMAT!r}; re-run `lowbit prepare`")
    if meta["dtype"] not in DTYPES:
        raise LowbitError(f"{f}: dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(meta["splits"], dict) or "train" not in meta["splits"]:
        raise LowbitError(f"{f}: 'splits' must map split names to shard lists and include 'train'")
    return meta
