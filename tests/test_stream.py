"""data.stream: documents read through HF datasets and tokenized on the fly, resumable by position.

Every test streams a small local file through datasets' own builders (no network)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SMALL, assert_user_error, cli, losses, read_metrics
from lowbit.data import train_tokenizer
from lowbit.data.stream import StreamData, TokenStream, stream_inputs
from lowbit.errors import LowbitError

pytestmark = pytest.mark.slow  # importing datasets alone takes seconds (done by the first test, not at collection)

DOCS = [f"document {i}: " + "word " * (i % 7) + "x = [1, 2, 3]\n" * (1 + i % 3) for i in range(40)]
DOCS[5] = ""  # an empty record: skipped, but it still counts as a record for positions


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, Path]:
    pytest.importorskip("datasets")
    f = tmp_path / "c.jsonl.gz"
    f.write_bytes(gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()))
    tok = train_tokenizer([d for d in DOCS if d], 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    return f, tmp_path / "tokenizer.json"


def reference_tokens(tok_path: Path) -> np.ndarray:
    data = StreamData("", str(tok_path))
    ids = [data.tokenizer.encode(d, add_special_tokens=False).ids + [data.eos_id] for d in DOCS if d]
    return np.concatenate([np.asarray(i) for i in ids])


def test_windows_are_the_joined_documents_across_epochs_and_resume_by_position(corpus):
    f, tok_path = corpus
    data = StreamData(str(f), str(tok_path))
    ref = reference_tokens(tok_path)
    seq = 16
    stream = TokenStream(str(f), data.tokenizer, data.eos_id, seq)
    n = 3 * len(ref) // seq  # three epochs and more
    tiled = np.tile(ref, 4)
    positions, windows = [], []
    for i in range(n):
        positions.append(stream.position())
        windows.append(stream.window())
        assert np.array_equal(windows[-1], tiled[i * seq:i * seq + seq + 1]), i
    assert positions[-1]["epoch"] == 2
    for k in (1, 7, n // 3 + 1, n - 2):  # a fresh stream sought to a recorded position continues alike
        again = TokenStream(str(f), data.tokenizer, data.eos_id, seq)
        again.seek(positions[k])
        assert all(np.array_equal(again.window(), w) for w in windows[k:k + 3]), k


def test_interrupted_and_resumed_loader_gives_the_uninterrupted_batches(corpus):
    f, tok_path = corpus
    data = StreamData(str(f), str(tok_path))

    def loader(rank=0, size=1):
        return stream_inputs(data, str(f), 8, 4, 6, 2, "text", "text", dp_rank=rank, dp_size=size)

    whole, val = loader()
    assert [x.shape for x, _ in val] == [(2, 8)] * 3
    straight = [whole.batch(s) for s in range(12)]
    first, _ = loader()
    for s in range(5):
        first.batch(s)
    saved = json.loads(json.dumps(first.position(5)))  # as a checkpoint keeps it
    resumed, _ = loader()
    resumed.seek(saved)
    for s in range(5, 12):
        x, y = resumed.batch(s)
        assert torch.equal(x, straight[s][0]) and torch.equal(y, straight[s][1])
        assert torch.equal(x[:, 1:], y[:, :-1])
    ranks = [loader(r, 2)[0] for r in range(2)]  # data parallel: the ranks' slices make the global batch
    for s in range(3):
        assert torch.equal(torch.cat([r.batch(s)[0] for r in ranks]), straight[s][0])
    with pytest.raises(RuntimeError):
        resumed.batch(3)  # a stream only goes forward


def test_validation_documents_are_not_trained_on(corpus):
    f, tok_path = corpus
    data = StreamData(str(f), str(tok_path))
    loader, val = stream_inputs(data, str(f), 8, 4, 4, 4, "text", "text")
    ref = reference_tokens(tok_path)
    eos = np.flatnonzero(ref == data.eos_id)
    val_end = 4 * 8 + 1  # tokens the validation windows span; training starts after that document's EOS
    first_train = int(eos[np.searchsorted(eos, val_end - 1)]) + 1
    x, _ = loader.batch(0)
    assert torch.equal(x[0], torch.from_numpy(ref[first_train:first_train + 8]))
    assert loader.position(1)["stream"]["document"] > 0


def test_stream_errors(corpus, tmp_path):
    f, tok_path = corpus
    with pytest.raises(LowbitError, match="data.tokenizer"):
        StreamData(str(f), "")
    data = StreamData(str(f), str(tok_path))
    with pytest.raises(LowbitError, match="no field 'body'"):
        TokenStream(str(f), data.tokenizer, data.eos_id, 8, field="body").window()
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with pytest.raises(LowbitError, match="no non-empty documents"):
        TokenStream(str(empty), data.tokenizer, data.eos_id, 8).window()
    with pytest.raises(LowbitError, match="shorter than"):
        stream_inputs(data, str(f), 8, 4, 200, 4, "text", "text")
    with pytest.raises(LowbitError, match="not found"):
        TokenStream(str(tmp_path / "nope.jsonl"), data.tokenizer, data.eos_id, 8)


def test_text_files_stream_one_document_per_file(tmp_path):
    pytest.importorskip("datasets")
    d = tmp_path / "txt"
    d.mkdir()
    for i, doc in enumerate(["first file\nwith two lines\n", "second\n"]):
        (d / f"{i}.txt").write_text(doc)
    tok = train_tokenizer(["first file with two lines second"], 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    data = StreamData(str(d), str(tmp_path / "tokenizer.json"))
    eos = data.eos_id
    stream = TokenStream(str(d), data.tokenizer, eos, 4)
    got = np.concatenate([stream.window()[:-1] for _ in range(6)])
    ids = [tok.encode(t, add_special_tokens=False).ids + [eos] for t in ["first file\nwith two lines\n", "second\n"]]
    want = np.tile(np.concatenate([np.asarray(i) for i in ids]), 10)[:len(got)]
    assert np.array_equal(got, want)


def test_train_streamed_stopped_and_resumed_matches_uninterrupted(corpus, tmp_path, capsys):
    """The trainer on a stream: a run stopped at step 3 and resumed gives the uninterrupted run's losses bit for
    bit, its checkpoint holding the stream position."""
    f, tok_path = corpus
    base = ["train", *SMALL, "--data.path", f, "--data.stream", "true", "--data.tokenizer", tok_path,
            "--data.seq_len", "16", "--train.steps", "6", "--checkpoint.every", "3", "--train.eval_every", "3"]
    assert cli(capsys, *base, "--run.dir", tmp_path / "a")[0] == 0
    assert cli(capsys, *base, "--run.dir", tmp_path / "b", "--train.stop_at", "3")[0] == 0
    code, _, err = cli(capsys, *base, "--run.dir", tmp_path / "b", "--run.resume", "true")
    assert code == 0, err
    assert losses(tmp_path / "a") == losses(tmp_path / "b") and len(losses(tmp_path / "a")) == 6
    assert losses(tmp_path / "a", "val_loss") == losses(tmp_path / "b", "val_loss")
    info = json.loads((tmp_path / "b" / "checkpoints" / "step_00000003" / "trainer.json").read_text())
    assert info["data_position"]["stream"]["document"] > 0
    assert_user_error(capsys, ["train", *SMALL, "--data.stream", "true", "--data.path", f,
                               "--run.dir", tmp_path / "c"], "data.tokenizer")
    assert any("val_loss" in r for r in read_metrics(tmp_path / "a"))
