"""Streaming data: documents read through HF `datasets` (streaming mode) and tokenized as training reads them.

For corpora not to be tokenized up front (`data.stream`). The prepared-shard path (`Loader`) draws windows in a
seeded order that is a pure function of the step; a stream can only be read forward, so here the order is the
stream's and the position is state: (epoch, document index, token offset) of the next window's first token. A
checkpoint records it (`position`) and resume `seek`s to it: the skipped documents are read again but not
tokenized. Windows are cut from the documents joined with EOS as prepared shards are (seq_len + 1 tokens, one
token of overlap), and the global batch s is the next global_batch windows, data-parallel rank r keeping the
r-th slice (each rank reads the whole stream: the union of the ranks' batches is the single-process batch).

The first `val_windows` windows are held out for validation and training starts at the next document, so no
document is in both. `datasets` is an optional dependency (`pip install "lowbit[data]"`); local files use its
"json" / "parquet" / "text" builders (one document per text file), anything else names a Hub dataset.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tokenizers import Tokenizer

from lowbit.data.documents import kind_of, list_files
from lowbit.data.tokenizer import eos_id, load_tokenizer, tokenizer_hash
from lowbit.errors import LowbitError

_ENCODE_DOCS = 64  # documents per encode_batch call (the Rust side runs them in parallel)


def open_documents(path: str, field: str, column: str, skip: int = 0) -> Iterator[str]:
    """The texts of `path` from record `skip` on (empty ones as ""): local files (.jsonl/.json, .parquet, text;
    compressed too) or a Hub dataset "owner/name" (or "owner/name:config"), its train split. The source is
    checked now, its records read as they are asked for."""
    try:
        import datasets
    except ImportError:
        raise LowbitError("data.stream needs HF datasets: pip install datasets") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    builder, kwargs, key = _source(path, field, column)
    return _records(datasets, path, builder, kwargs, key, skip)


def _records(datasets, path: str, builder: str, kwargs: dict, key: str, skip: int) -> Iterator[str]:
    try:
        ds = datasets.load_dataset(builder, split="train", streaming=True, **kwargs)
        for i, record in enumerate(ds.skip(skip) if skip else ds):
            if key not in record:
                raise LowbitError(f"data.stream: {path}: record {skip + i} has no field {key!r} "
                                  f"(has {', '.join(record)}; set data.field / data.column)")
            text = record[key]
            if text is not None and not isinstance(text, str):
                raise LowbitError(f"data.stream: {path}: record {skip + i}: {key!r} is {type(text).__name__}, "
                                  f"not a string")
            yield text or ""  # empty records too: a position counts records
    except LowbitError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the reader is a bad input, said on one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise LowbitError(f"data.stream: cannot read {path}: {type(e).__name__}: {first}") from None


def _source(path: str, field: str, column: str) -> tuple[str, dict, str]:
    p = Path(path).expanduser()
    if not p.exists():
        if path.count("/") != 1 or path.startswith((".", "/", "~")):
            raise LowbitError(f"data path not found: {p} (data.stream also takes a Hub dataset owner/name)")
        name, _, config = path.partition(":")
        return name, {"name": config or None}, field
    if (p / "meta.json").is_file():
        raise LowbitError(f"data.stream: {p} is a prepared dataset; train on it without data.stream")
    files = list_files([p])
    kinds = {kind_of(f)[0] for f in files}
    if not files:
        raise LowbitError(f"data.stream: no data files in {p}")
    if len(kinds) > 1:
        raise LowbitError(f"data.stream: {p} mixes {', '.join(sorted(kinds))}; stream one kind of file")
    kind = kinds.pop()
    names = [str(f) for f in files]
    if kind in (".jsonl", ".json"):
        return "json", {"data_files": names}, field
    if kind == ".parquet":
        return "parquet", {"data_files": names}, column
    return "text", {"data_files": names, "sample_by": "document"}, "text"


class TokenStream:
    """Documents tokenized (EOS after each) as they are read, cut into windows of seq_len + 1 tokens that
    overlap by one; `position` is where the next window starts, `seek` goes back there."""

    def __init__(self, path: str, tok: Tokenizer, eos: int, seq_len: int, field: str = "text",
                 column: str = "text"):
        self.path, self.tok, self.eos, self.seq_len = path, tok, eos, seq_len
        self.field, self.column = field, column
        self.seek({"epoch": 0, "document": 0, "offset": 0})

    def seek(self, position: dict) -> None:
        epoch, document, self.offset = (int(position[k]) for k in ("epoch", "document", "offset"))
        self._next = (epoch, document)  # the (epoch, record index) the reader yields next
        self._docs = open_documents(self.path, self.field, self.column, skip=document)
        self._buffer: collections.deque = collections.deque()  # (epoch, record index, tokens) read ahead
        self._read_any = document > 0 or epoch > 0

    def position(self) -> dict:
        epoch, document = self._buffer[0][:2] if self._buffer else self._next
        return {"epoch": epoch, "document": document, "offset": self.offset}

    def window(self) -> np.ndarray:
        """The next window; the stream moves on by seq_len tokens."""
        need = self.seq_len + 1
        while sum(len(d[2]) for d in self._buffer) - self.offset < need:
            self._fill()
        parts, have, first = [], 0, self.offset
        for _, _, tokens in self._buffer:
            parts.append(tokens[first:first + need - have])
            have += len(parts[-1])
            first = 0
            if have == need:
                break
        self.offset += self.seq_len
        while self._buffer and self.offset >= len(self._buffer[0][2]):
            self.offset -= len(self._buffer.popleft()[2])
        return np.concatenate(parts)

    def skip_to_next_document(self) -> None:
        """Move past the document the next window would start in (the validation/training boundary)."""
        while not self._buffer:
            self._fill()
        self._buffer.popleft()
        self.offset = 0

    def _fill(self) -> None:
        """Read and tokenize the next few documents; at the end of the stream start the next epoch."""
        epoch, document = self._next
        texts, where = [], []
        for text in self._docs:
            if text:  # an empty record still counts: positions are record indices, as datasets' skip() counts
                texts.append(text)
                where.append(document)
            document += 1
            if len(texts) == _ENCODE_DOCS:
                break
        self._next = (epoch, document)
        if not texts:
            if not self._read_any:
                raise LowbitError(f"data.stream: {self.path} holds no non-empty documents")
            self._next = (epoch + 1, 0)
            self._docs = open_documents(self.path, self.field, self.column)
            return
        self._read_any = True
        for i, enc in zip(where, self.tok.encode_batch(texts, add_special_tokens=False)):
            self._buffer.append((epoch, i, np.asarray(enc.ids + [self.eos], dtype=np.int64)))


class StreamLoader:
    """`Loader`'s interface over a TokenStream: batch(step) for consecutive steps, the position for a checkpoint
    (`position`) and back (`seek`)."""

    def __init__(self, stream: TokenStream, global_batch: int, dp_rank: int = 0, dp_size: int = 1):
        if global_batch < 1 or dp_size < 1 or global_batch % dp_size:
            raise LowbitError(
                f"global batch size {global_batch} must be a positive multiple of the data-parallel size {dp_size}"
            )
        self.stream, self.seq_len, self.global_batch = stream, stream.seq_len, global_batch
        self.local_batch = global_batch // dp_size
        self.offset = dp_rank * self.local_batch
        self.next_step = 0

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if step != self.next_step:
            raise RuntimeError(f"a stream gives batches in order: asked for {step}, at {self.next_step}")
        rows = [self.stream.window() for _ in range(self.global_batch)]
        self.next_step += 1
        w = torch.from_numpy(np.stack(rows[self.offset:self.offset + self.local_batch]))
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def position(self, step: int) -> dict:
        """What a checkpoint after `step` steps records; `seek` takes it back."""
        if step != self.next_step:
            raise RuntimeError(f"the stream is at step {self.next_step}, not {step}")
        where = self.stream.position()
        return {"batch": step, "epoch": where["epoch"], "stream": where}

    def seek(self, position: dict) -> None:
        if "stream" not in position:
            raise LowbitError("run.resume: the checkpoint holds no stream position (it was not trained with "
                              "data.stream)")
        self.stream.seek(position["stream"])
        self.next_step = int(position["batch"])

    def epoch_of(self, step: int) -> float:
        """The epoch the stream is in (whole epochs: a stream's length is not known before its end)."""
        return float(self.stream.position()["epoch"])


class StreamData:
    """What the trainer needs of a dataset, for a stream: the tokenizer (path, hash, vocabulary, EOS)."""

    def __init__(self, path: str, tokenizer: str, eos_token: str = ""):
        if not tokenizer:
            raise LowbitError("data.stream needs data.tokenizer: a stream is not read up front to train one")
        self.path = path
        self.tokenizer_path = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
        self.tokenizer = load_tokenizer(self.tokenizer_path, eos_token)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.eos_id = eos_id(self.tokenizer, eos_token)
        self.meta = {"tokenizer_hash": tokenizer_hash(self.tokenizer), "vocab_size": self.vocab_size,
                     "eos_id": self.eos_id}


def stream_inputs(data: StreamData, path: str, seq_len: int, global_batch: int, val_windows: int, micro: int,
                  field: str, column: str, dp_rank: int = 0, dp_size: int = 1) -> tuple[StreamLoader, list]:
    """The training loader and the validation batches (in micro-batches): the stream's first `val_windows`
    windows, training starting at the document after them."""
    stream = TokenStream(path, data.tokenizer, data.eos_id, seq_len, field, column)
    windows = [stream.window() for _ in range(val_windows)]
    if val_windows:
        stream.skip_to_next_document()
        if stream.position()["epoch"] > 0:
            raise LowbitError(f"data.stream: {path} is shorter than the {val_windows} validation windows "
                              f"(train.eval_batches x train.batch_size) plus one document to train on")
    val = []
    for i in range(0, len(windows), micro):
        w = torch.from_numpy(np.stack(windows[i:i + micro]))
        val.append((w[:, :-1].contiguous(), w[:, 1:].contiguous()))
    return StreamLoader(stream, global_batch, dp_rank, dp_size), val
