"""On-disk token shards: raw little-endian arrays, each described by (file, tokens, sha256)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

FORMAT = "lowbit-tokens-v1"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def token_dtype(vocab_size: int) -> str:
    """Smallest supported dtype name that holds every id of a vocabulary this size."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def file_sha256(path: Path, chunk: int = 1 << 23) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """Appends tokens to `<split>_00000.bin`, `<split>_00001.bin`, ... of at most `shard_tokens` each."""

    def __init__(self, directory: Path, split: str, dtype: str, shard_tokens: int):
        self.directory = Path(directory)
        self.split = split
        self.dtype = DTYPES[dtype]
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self._fh = None
        self._hash = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        while tokens.size:
            if self._fh is None:
                self._open()
            take = min(tokens.size, self.shard_tokens - self._count)
            data = tokens[:take].tobytes()
            self._fh.write(data)
            self._hash.update(data)
            self._count += take
            tokens = tokens[take:]
            if self._count == self.shard_tokens:
                self._close_shard()

    def close(self) -> list[dict]:
        """Finish the last shard; returns the meta.json entries. An empty split has no files."""
        if self._fh is not None:
            self._close_shard()
        return self.shards

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):05d}.bin"
        self._fh = open(self.directory / name, "wb")
        self._hash = hashlib.sha256()
        self._count = 0
        self.shards.append({"file": name, "tokens": 0, "sha256": ""})

    def _close_shard(self) -> None:
        self._fh.close()
        self.shards[-1].update(tokens=self._count, sha256=self._hash.hexdigest())
        self._fh = None
