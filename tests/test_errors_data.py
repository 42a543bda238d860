"""Bad data: one line on stderr naming the file, exit status 2, no run directory or cache entry left behind."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL, assert_user_error
from lowbit.data import TokenDataset, prepare

TEXT = "def f(x):\n    return x + 1\n\nclass A:\n    pass\n" * 200


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """A tiny prepared dataset (300-token vocabulary); tests damage copies of it."""
    root = tmp_path_factory.mktemp("ds")
    (root / "a.txt").write_text(TEXT)
    prepare([root / "a.txt"], root / "data", vocab_size=300, val_fraction=0.1)
    return root / "data"


@pytest.fixture
def bad(tmp_path, dataset) -> Path:
    shutil.copytree(dataset, tmp_path / "bad")
    return tmp_path / "bad"


def train_fails(capsys, tmp_path, data, *needles):
    """`lowbit train` on `data` is refused on one line naming `needles`; nothing is left where the run would go."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    line = assert_user_error(capsys, ["train", *SMALL, "--data.path", data, "--data.cache_dir", cache,
                                      "--run.dir", run], *needles)
    assert not run.exists()
    assert not cache.exists() or not any(p.name == "meta.json" for p in cache.rglob("*"))
    return line


def edit_meta(d: Path, **changes) -> None:
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, **changes}))


def test_the_intact_dataset_opens(dataset):
    assert TokenDataset(dataset).split("train").num_tokens > 100


def test_prepared_dataset_without_meta_json(capsys, tmp_path, bad):
    (bad / "meta.json").unlink()
    train_fails(capsys, tmp_path, bad, bad / "meta.json", "is missing", "lowbit prepare")
    parent = tmp_path / "corpus"  # nested in a raw-text directory, it is not read as text either
    parent.mkdir()
    (parent / "b.txt").write_text(TEXT)
    shutil.move(bad, parent / "bad")
    train_fails(capsys, tmp_path, parent, parent / "bad" / "meta.json", "is missing")


def test_prepared_dataset_without_tokenizer_json(capsys, tmp_path, bad):
    (bad / "tokenizer.json").unlink()
    train_fails(capsys, tmp_path, bad, bad / "tokenizer.json", "is missing", "lowbit prepare")


@pytest.mark.parametrize("content", ["{not json", '{"version": "1.0"}', "[]"])
def test_prepared_dataset_with_unreadable_tokenizer_json(capsys, tmp_path, bad, content):
    (bad / "tokenizer.json").write_text(content)
    train_fails(capsys, tmp_path, bad, bad / "tokenizer.json", "lowbit prepare")


def test_vocab_size_below_the_tokenizers(capsys, tmp_path, bad):
    edit_meta(bad, vocab_size=260)
    train_fails(capsys, tmp_path, bad, bad / "meta.json", "vocab_size 260", "lowbit prepare")


def test_token_ids_beyond_vocab_size(capsys, tmp_path, bad):
    shard = bad / "train_00000.bin"
    meta = json.loads((bad / "meta.json").read_text())
    ids = np.fromfile(shard, dtype="<u2")
    ids[7] = meta["vocab_size"] + 1000
    ids.tofile(shard)
    meta["splits"]["train"][0]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    edit_meta(bad, splits=meta["splits"])
    train_fails(capsys, tmp_path, bad, shard, f"token id {ids[7]}", f"vocab_size {meta['vocab_size']}")


@pytest.mark.parametrize("data", [b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50, bytes(range(128, 256)) * 20,
                                  "text".encode("utf-16")])
def test_binary_file_as_raw_text(capsys, tmp_path, data):
    f = tmp_path / "model.bin"
    f.write_bytes(data)
    train_fails(capsys, tmp_path, f, f, "not UTF-8 text")
    assert_user_error(capsys, ["prepare", f, "--out", tmp_path / "out", "--vocab-size", "300"], f, "not UTF-8")
    assert not (tmp_path / "out").exists()


def test_a_few_bad_bytes_in_text_are_replaced(tmp_path):
    from lowbit.data import read_documents

    f = tmp_path / "latin1.txt"
    f.write_bytes(TEXT.encode() + "caf\xe9\r\n".encode("latin-1"))
    assert list(read_documents([f])) == [TEXT + "caf\ufffd\n"]
