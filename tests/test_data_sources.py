"""Data sources beyond plain local text: compressed inputs, a named EOS token."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers import models as tok_models

from conftest import assert_user_error
from lowbit.data import TokenDataset, load_tokenizer, prepare, read_documents, resolve_dataset
from lowbit.errors import LowbitError

DOCS = ["def add(a, b):\n    return a + b\n", "naïve café — ünïcödé ✓ 漢字\n", "The quick brown fox. " * 4]


def _compress(data: bytes, codec: str) -> bytes:
    if codec == ".gz":
        return gzip.compress(data)
    if codec == ".bz2":
        return bz2.compress(data)
    if codec == ".xz":
        return lzma.compress(data)
    return pytest.importorskip("zstandard").ZstdCompressor().compress(data)


def _jsonl(docs) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


@pytest.mark.parametrize("codec", [".gz", ".bz2", ".xz", ".zst"])
def test_compressed_inputs_read_as_their_kind(tmp_path, codec):
    """Each kind compressed reads as the same documents as uncompressed; a directory walk finds them too."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = tmp_path / "in"
    d.mkdir()
    (d / f"a.txt{codec}").write_bytes(_compress(DOCS[0].encode(), codec))
    (d / f"b.jsonl{codec}").write_bytes(_compress(_jsonl(DOCS[1:]), codec))
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "c.parquet")
    (d / f"c.parquet{codec}").write_bytes(_compress((tmp_path / "c.parquet").read_bytes(), codec))
    (d / f"skipped.bin{codec}").write_bytes(_compress(b"\0\1\2", codec))  # not a text kind: not walked
    assert list(read_documents([d])) == DOCS[:1] + DOCS[1:] + DOCS
    assert list(read_documents([d / f"b.jsonl{codec}"])) == DOCS[1:]


@pytest.mark.parametrize("name", ["corpus.jsonl.gz", "corpus.txt.gz", "corpus.txt.xz", "corpus.txt.bz2"])
def test_corrupt_compressed_file_is_one_line(tmp_path, name):
    f = tmp_path / name
    f.write_bytes(b"this was never compressed, just named so\n" * 10)
    with pytest.raises(LowbitError, match="not a readable") as e:
        list(read_documents([f]))
    assert "\n" not in str(e.value) and name in str(e.value)
    good = _compress(_jsonl(DOCS * 50), "." + name.rsplit(".", 1)[1])
    f.write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(LowbitError, match="not a readable"):
        list(read_documents([f]))


@pytest.mark.parametrize("kind", [".txt", ".jsonl"])
def test_compressed_garbage_is_refused_not_trained_on(tmp_path, capsys, kind):
    """A valid archive of non-text bytes (a wrong codec, a binary file) decodes to replacement characters:
    refused on one line by `lowbit prepare`, and nothing is written."""
    rng = np.random.default_rng(0)
    garbage = bytes(rng.integers(128, 256, 20000, dtype=np.uint8))  # never valid UTF-8, no NUL byte
    if kind == ".jsonl":  # valid JSON lines whose strings were decoded from the wrong bytes
        garbage = b"".join(b'{"text": "' + garbage[i:i + 200] + b'"}\n' for i in range(0, 20000, 200))
    f = tmp_path / f"corpus{kind}.gz"
    f.write_bytes(gzip.compress(garbage))
    assert_user_error(capsys, ["prepare", f, "--out", tmp_path / "ds", "--vocab-size", "300"],
                      str(f), "UTF-8 text")
    assert not (tmp_path / "ds").exists()


def test_zstd_without_zstandard_is_one_line(tmp_path, monkeypatch):
    f = tmp_path / "a.txt.zst"
    f.write_bytes(b"\x28\xb5\x2f\xfd")
    monkeypatch.setitem(sys.modules, "zstandard", None)  # import zstandard now raises ImportError
    with pytest.raises(LowbitError, match="pip install zstandard") as e:
        list(read_documents([f]))
    assert "\n" not in str(e.value)


def test_compressed_corpus_prepares_like_plain(tmp_path):
    (tmp_path / "plain.jsonl").write_bytes(_jsonl(DOCS * 5))
    (tmp_path / "packed.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS * 5)))
    a = prepare([tmp_path / "plain.jsonl"], tmp_path / "a", vocab_size=300, val_fraction=0.2)
    b = prepare([tmp_path / "packed.jsonl.gz"], tmp_path / "b", vocab_size=300, val_fraction=0.2)
    assert a["tokenizer_hash"] == b["tokenizer_hash"] and a["splits"] == b["splits"]


# ---------------------------------------------------------------- a named EOS token


def _llama3_style_tokenizer(path: Path) -> Path:
    """A byte-level BPE whose end-of-document token is Llama 3's name, not one lowbit looks for."""
    tok = Tokenizer(tok_models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(DOCS, trainer=trainer)
    tok.save(str(path))
    return path


def test_eos_token_names_the_tokenizers_eos(tmp_path, capsys):
    tok = _llama3_style_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "c.jsonl").write_bytes(_jsonl(DOCS * 4))
    assert_user_error(capsys, ["prepare", tmp_path / "c.jsonl", "--out", tmp_path / "ds", "--tokenizer", tok],
                      "no end-of-document token", "eos_token")
    assert_user_error(capsys, ["prepare", tmp_path / "c.jsonl", "--out", tmp_path / "ds", "--tokenizer", tok,
                               "--eos-token", "<|eot|>"], "'<|eot|>'")
    meta = prepare([tmp_path / "c.jsonl"], tmp_path / "ds", tokenizer=tok, eos_token="<|end_of_text|>",
                   val_fraction=0.25)
    end = load_tokenizer(tok, "<|end_of_text|>").token_to_id("<|end_of_text|>")
    assert meta["eos_id"] == end == 1 and meta["eos_token"] == "<|end_of_text|>"
    ds = TokenDataset(tmp_path / "ds", tokenizer=str(tok))  # the dataset remembers which token ends documents
    ids = np.concatenate([np.asarray(s) for s in ds.split("train").shards])
    assert ids[-1] == end and (ids == end).sum() == meta["documents"]["train"]


def test_eos_token_through_the_cache_and_trained_tokenizers(tmp_path):
    (tmp_path / "c.jsonl").write_bytes(_jsonl(DOCS * 4))
    tok = _llama3_style_tokenizer(tmp_path / "tokenizer.json")
    out = resolve_dataset(str(tmp_path / "c.jsonl"), tokenizer=str(tok), eos_token="<|end_of_text|>",
                          cache_dir=tmp_path / "cache")
    assert json.loads((out / "meta.json").read_text())["eos_id"] == 1
    # a tokenizer lowbit trains takes the named token as its id 0
    out2 = resolve_dataset(str(tmp_path / "c.jsonl"), vocab_size=300, eos_token="<|end_of_text|>",
                           cache_dir=tmp_path / "cache")
    assert out2 != out and load_tokenizer(out2, "<|end_of_text|>").token_to_id("<|end_of_text|>") == 0
    assert sorted(os.listdir(tmp_path / "cache")) == sorted([out.name, out2.name])


@pytest.mark.slow
def test_train_and_generate_with_a_named_eos_token(tmp_path, capsys):
    from conftest import SMALL, cli

    tok = _llama3_style_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "c.jsonl").write_bytes(_jsonl(DOCS * 40))
    run = tmp_path / "run"
    base = ["train", *SMALL, "--data.path", tmp_path / "c.jsonl", "--data.tokenizer", tok, "--train.steps", "2",
            "--data.cache_dir", tmp_path / "cache", "--run.dir", run, "--data.val_fraction", "0.1"]
    assert_user_error(capsys, base, "eos_token")
    code, out, err = cli(capsys, *base, "--data.eos_token", "<|end_of_text|>")
    assert code == 0, err
    assert 'eos_token = "<|end_of_text|>"' in (run / "config.toml").read_text()
    code, out, err = cli(capsys, "generate", run, "--max-new-tokens", "3")
    assert code == 0, err
