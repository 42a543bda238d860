"""Data pipeline: tokenizer, prepare, dataset verification, loader order. Tiny corpora, fast."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lowbit.data import (
    EOS_TOKEN,
    Loader,
    TokenDataset,
    TokenSplit,
    add_prepare_args,
    builtin_corpus_files,
    default_dataset,
    eos_id,
    load_tokenizer,
    prepare,
    read_documents,
    resolve_dataset,
    run_prepare,
    token_dtype,
    tokenizer_hash,
    train_tokenizer,
    val_batches,
)
from lowbit.errors import LowbitError

# the module whose names the tests swap
cache_mod = sys.modules["lowbit.data.cache"]

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "naïve café — ünïcödé ✓ 漢字\n",
    "for i in range(10):\n    print(i * i)\n",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n",
    "x = [1, 2, 3]\ny = {k: v for k, v in zip('abc', x)}\n",
]


def one_line_error(excinfo, *needles: str) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg
    return msg


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for i, doc in enumerate(DOCS):
        (d / f"doc{i}.txt").write_text(doc, encoding="utf-8")
    return d


def split_docs(ds: TokenDataset, split: str) -> list[str]:
    """Decode a split's tokens back to documents (EOS-terminated)."""
    tok = ds.load_tokenizer()
    ids = np.concatenate([np.asarray(s) for s in ds.split(split).shards] or [np.empty(0, np.int64)]).tolist()
    docs, cur = [], []
    for t in ids:
        if t == ds.eos_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(t)
    assert not cur, "split does not end with EOS"
    return docs


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_roundtrip_eos_and_hash(tmp_path):
    tok = train_tokenizer(DOCS, 300)
    assert tok.token_to_id(EOS_TOKEN) == 0 and eos_id(tok) == 0
    s = "naïve x = [1, 2]\n\tunseen ☃ bytes"
    assert tok.decode(tok.encode(s).ids) == s
    tok.save(str(tmp_path / "tokenizer.json"))
    assert tokenizer_hash(load_tokenizer(tmp_path)) == tokenizer_hash(tok)
    assert tokenizer_hash(load_tokenizer(tmp_path / "tokenizer.json")) == tokenizer_hash(tok)
    assert tokenizer_hash(train_tokenizer(DOCS[:2], 300)) != tokenizer_hash(tok)


def test_tokenizer_errors(tmp_path):
    with pytest.raises(LowbitError) as e:
        train_tokenizer(DOCS, 257)
    one_line_error(e, "data.vocab_size")
    with pytest.raises(LowbitError) as e:
        load_tokenizer(tmp_path / "nope.json")
    one_line_error(e, "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(LowbitError) as e:
        load_tokenizer(tmp_path / "bad.json")
    one_line_error(e, "bad.json")


def test_eos_fallback_names(tmp_path):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "</s>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    assert eos_id(tok) == 1
    tok.save(str(tmp_path / "t.json"))
    assert eos_id(load_tokenizer(tmp_path / "t.json")) == 1
    bare = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    bare.save(str(tmp_path / "bare.json"))
    with pytest.raises(LowbitError) as e:
        load_tokenizer(tmp_path / "bare.json")
    one_line_error(e, "bare.json", EOS_TOKEN)


# ---------------------------------------------------------------- reading documents


def test_read_documents_formats_and_walk(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "b.md").write_text("bee")
    (d / "a.txt").write_text("ay")
    (d / "sub" / "c.py").write_text("sea")
    (d / "skip.bin").write_bytes(b"\x00\x01")  # unknown suffix inside a directory: ignored
    (d / ".hidden").mkdir()
    (d / ".hidden" / "h.txt").write_text("hidden")
    (d / "rows.jsonl").write_text('{"content": "j1"}\n\n{"content": "j2"}\n')
    assert list(read_documents([d], field="content")) == ["ay", "bee", "j1", "j2", "sea"]
    # An explicitly named file is read whatever its suffix.
    (tmp_path / "notes.weird").write_bytes(b"caf\xe9!")
    assert list(read_documents([tmp_path / "notes.weird"])) == ["caf\ufffd!"]


def test_read_documents_errors(tmp_path):
    with pytest.raises(LowbitError) as e:
        list(read_documents([tmp_path / "missing"]))
    one_line_error(e, "data path not found", "missing")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(LowbitError) as e:
        list(read_documents([bad]))
    one_line_error(e, "bad.jsonl:2")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text('{"body": "x"}\n')
    with pytest.raises(LowbitError) as e:
        list(read_documents([nofield]))
    one_line_error(e, "nofield.jsonl:1", "'text'")


# ---------------------------------------------------------------- prepare


def test_prepare_text_dir(text_dir, tmp_path):
    out = tmp_path / "ds"
    meta = prepare([text_dir], out, vocab_size=300, val_fraction=0.3, seed=1)
    assert json.loads((out / "meta.json").read_text()) == meta
    assert meta["format"] == "lowbit-tokens-v1" and meta["dtype"] == "uint16" and meta["eos_id"] == 0
    assert meta["sources"] == [str(text_dir)]
    assert meta["documents"]["train"] + meta["documents"]["val"] == len(DOCS)
    assert meta["documents"]["train"] >= 1 and meta["documents"]["val"] >= 1
    ds = TokenDataset(out)
    for split in ("train", "val"):
        entries = meta["splits"][split]
        assert entries[0]["file"] == f"{split}_00000.bin"
        assert sum(e["tokens"] for e in entries) == meta["tokens"][split] == ds.split(split).num_tokens
        assert (out / entries[0]["file"]).stat().st_size == 2 * entries[0]["tokens"]
    train, val = split_docs(ds, "train"), split_docs(ds, "val")
    assert sorted(train + val) == sorted(DOCS)
    assert train == [d for d in DOCS if d in train]  # corpus order kept
    assert tokenizer_hash(ds.load_tokenizer()) == meta["tokenizer_hash"]
    assert not list(tmp_path.glob(".tmp-*"))
    # Same inputs and seed: same split, same bytes.
    meta2 = prepare([text_dir], tmp_path / "ds2", vocab_size=300, val_fraction=0.3, seed=1)
    assert meta2["splits"] == meta["splits"]


def test_prepare_jsonl_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    jl = tmp_path / "docs.jsonl"
    jl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    meta = prepare([jl], tmp_path / "dj", vocab_size=300, field="body", val_fraction=0.2)
    ds = TokenDataset(tmp_path / "dj")
    assert sorted(split_docs(ds, "train") + split_docs(ds, "val")) == sorted(DOCS)
    assert meta["documents"]["train"] + meta["documents"]["val"] == len(DOCS)

    pf = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"content": DOCS + [None], "n": list(range(len(DOCS) + 1))}), pf)
    meta = prepare([pf], tmp_path / "dp", vocab_size=300, column="content", val_fraction=0.2)
    ds = TokenDataset(tmp_path / "dp")
    assert sorted(split_docs(ds, "train") + split_docs(ds, "val")) == sorted(DOCS)

    with pytest.raises(LowbitError) as e:
        prepare([pf], tmp_path / "dq", vocab_size=300)  # default column "text" is absent
    one_line_error(e, "docs.parquet", "'text'")
    assert not (tmp_path / "dq").exists()


def test_prepare_with_given_tokenizer_and_literal_eos_text(text_dir, tmp_path):
    tok = train_tokenizer(DOCS, 300)
    tok.save(str(tmp_path / "tok.json"))
    (text_dir / "z.txt").write_text(f"before {EOS_TOKEN} after")
    meta = prepare([text_dir], tmp_path / "ds", tokenizer=tmp_path / "tok.json", val_fraction=0.0)
    assert meta["tokenizer_hash"] == tokenizer_hash(tok)
    assert meta["splits"]["val"] == [] and meta["tokens"]["val"] == 0  # val_fraction 0: no validation data
    ds = TokenDataset(tmp_path / "ds", tokenizer=str(tmp_path / "tok.json"))
    # The literal text is tokenized as text: still exactly one EOS per document.
    assert split_docs(ds, "train") == DOCS + [f"before {EOS_TOKEN} after"]
    assert val_batches(ds.split("val"), 4, 2, 10) == []


def test_uint32_for_large_vocab(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert token_dtype(256) == token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32"
    vocab = {EOS_TOKEN: 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([EOS_TOKEN])
    tok.save(str(tmp_path / "big.json"))
    (tmp_path / "c.txt").write_text("w69999 w5 w65535")
    meta = prepare([tmp_path / "c.txt"], tmp_path / "ds", tokenizer=tmp_path / "big.json", val_fraction=0.0)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002
    ds = TokenDataset(tmp_path / "ds")
    assert np.asarray(ds.split("train").shards[0]).tolist() == [70_001, 7, 65_537, 0]
    assert (tmp_path / "ds" / "train_00000.bin").stat().st_size == 4 * 4


def test_single_document_is_split_by_tokens(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text(DOCS[1] * 4)
    meta = prepare([f], tmp_path / "ds", vocab_size=300, val_fraction=0.25)
    t = meta["tokens"]
    assert t["val"] == max(1, int((t["train"] + t["val"]) * 0.25))
    ds = TokenDataset(tmp_path / "ds")
    tok = ds.load_tokenizer()
    ids = np.concatenate([ds.split("train").shards[0], ds.split("val").shards[0]]).tolist()
    assert ids[-1] == 0 and tok.decode(ids[:-1]) == DOCS[1] * 4


def test_prepare_shards(text_dir, tmp_path):
    meta = prepare([text_dir], tmp_path / "ds", vocab_size=300, val_fraction=0.0, shard_tokens=16)
    entries = meta["splits"]["train"]
    assert len(entries) > 2 and all(e["tokens"] == 16 for e in entries[:-1]) and 1 <= entries[-1]["tokens"] <= 16
    assert [e["file"] for e in entries[:2]] == ["train_00000.bin", "train_00001.bin"]
    split = TokenDataset(tmp_path / "ds").split("train")
    assert split.num_windows(5) == sum((e["tokens"] - 1) // 5 for e in entries)
    # Windows stay inside a shard: shard 1 starts at window (16-1)//5 = 3.
    assert split.window(3, 5).tolist() == np.asarray(split.shards[1][:6]).tolist()
    assert split.window(1, 5).tolist() == np.asarray(split.shards[0][5:11]).tolist()


def test_prepare_empty_corpus(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LowbitError) as e:
        prepare([empty], tmp_path / "o1", vocab_size=300)
    one_line_error(e, "empty corpus", "empty")
    (empty / "a.txt").write_text("")
    (empty / "b.jsonl").write_text("")
    with pytest.raises(LowbitError) as e:
        prepare([empty], tmp_path / "o2", vocab_size=300)
    one_line_error(e, "empty corpus")
    tok = train_tokenizer(DOCS, 300)
    tok.save(str(tmp_path / "tok.json"))
    with pytest.raises(LowbitError):  # with a given tokenizer the check comes after encoding
        prepare([empty], tmp_path / "o3", tokenizer=tmp_path / "tok.json")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()
    assert not list(tmp_path.glob(".tmp-*"))


def test_prepare_errors(text_dir, tmp_path):
    with pytest.raises(LowbitError) as e:
        prepare([tmp_path / "nowhere"], tmp_path / "o", vocab_size=300)
    one_line_error(e, "data path not found")
    with pytest.raises(LowbitError) as e:
        prepare([text_dir], tmp_path / "o", vocab_size=100)
    one_line_error(e, "data.vocab_size")
    with pytest.raises(LowbitError) as e:
        prepare([text_dir], tmp_path / "o", vocab_size=300, val_fraction=1.0)
    one_line_error(e, "data.val_fraction")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "keep.txt").write_text("mine")
    with pytest.raises(LowbitError) as e:
        prepare([text_dir], tmp_path / "junk", vocab_size=300)
    one_line_error(e, "junk", "not a prepared dataset")
    assert (tmp_path / "junk" / "keep.txt").read_text() == "mine"
    assert not (tmp_path / "o").exists()


def test_prepare_never_overwrites_and_fails_atomically(text_dir, tmp_path):
    out = tmp_path / "ds"
    meta = prepare([text_dir], out, vocab_size=300)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(LowbitError) as e:
        prepare([text_dir], out, vocab_size=300)
    one_line_error(e, str(out), "--overwrite")
    # A prepare that fails midway (bad line after good ones) leaves the old dataset untouched.
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 5 + "garbage\n")
    with pytest.raises(LowbitError) as e:
        prepare([bad], out, vocab_size=300, overwrite=True)
    one_line_error(e, "bad.jsonl:6")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "corpus", "ds"]
    meta2 = prepare([text_dir], out, vocab_size=400, overwrite=True)
    assert meta2["tokenizer_hash"] != meta["tokenizer_hash"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "corpus", "ds"]
    # An existing empty directory is fine to fill.
    (tmp_path / "empty_out").mkdir()
    prepare([text_dir], tmp_path / "empty_out", vocab_size=300)
    assert (tmp_path / "empty_out" / "meta.json").is_file()


def test_walk_skips_prepared_dataset_inside_input(text_dir):
    n = len(list(read_documents([text_dir])))
    prepare([text_dir], text_dir / "prepared", vocab_size=300)
    assert len(list(read_documents([text_dir]))) == n


# ---------------------------------------------------------------- dataset verification


@pytest.fixture
def dataset(text_dir, tmp_path) -> Path:
    out = tmp_path / "ds"
    prepare([text_dir], out, vocab_size=300, val_fraction=0.3)
    return out


def test_dataset_attributes(dataset):
    ds = TokenDataset(dataset)
    assert ds.path == dataset and ds.tokenizer_path == dataset / "tokenizer.json"
    assert ds.vocab_size == ds.load_tokenizer().get_vocab_size() and ds.eos_id == 0
    assert isinstance(ds.split("train").shards[0], np.memmap)
    with pytest.raises(LowbitError) as e:
        ds.split("test")
    one_line_error(e, "'test'")


def test_dataset_not_prepared(tmp_path):
    with pytest.raises(LowbitError) as e:
        TokenDataset(tmp_path)
    one_line_error(e, "not a prepared dataset", str(tmp_path), "lowbit prepare")
    (tmp_path / "meta.json").write_text("{broken")
    with pytest.raises(LowbitError) as e:
        TokenDataset(tmp_path)
    one_line_error(e, "meta.json")


def test_dataset_shard_size_mismatch(dataset):
    f = dataset / "train_00000.bin"
    data = f.read_bytes()
    f.write_bytes(data[:-2])
    with pytest.raises(LowbitError) as e:
        TokenDataset(dataset)
    one_line_error(e, "train_00000.bin", f"size {len(data) - 2} bytes", f"meta.json says {len(data)}")
    f.unlink()
    with pytest.raises(LowbitError) as e:
        TokenDataset(dataset)
    one_line_error(e, "train_00000.bin", "missing")


def test_dataset_checksum_mismatch(dataset):
    f = dataset / "val_00000.bin"
    data = bytearray(f.read_bytes())
    data[0] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(LowbitError) as e:
        TokenDataset(dataset)
    one_line_error(e, "val_00000.bin", "checksum mismatch")
    TokenDataset(dataset, verify=False)  # size still right: opening unverified works


def test_dataset_tokenizer_mismatch(dataset, tmp_path):
    train_tokenizer(DOCS, 280).save(str(tmp_path / "other.json"))
    with pytest.raises(LowbitError) as e:
        TokenDataset(dataset, tokenizer=str(tmp_path / "other.json"))
    one_line_error(e, "other.json", "differs", str(dataset))
    TokenDataset(dataset, tokenizer=str(dataset / "tokenizer.json"))


# ---------------------------------------------------------------- loader


def make_split(n_tokens: int, shard_tokens: int | None = None) -> TokenSplit:
    data = np.arange(n_tokens, dtype=np.uint16)
    step = shard_tokens or n_tokens
    return TokenSplit([data[i : i + step] for i in range(0, n_tokens, step)], "train")


def test_loader_deterministic_and_shifted():
    split = make_split(1000)
    a = Loader(split, seq_len=8, global_batch=4, seed=3)
    b = Loader(split, seq_len=8, global_batch=4, seed=3)
    x, y = a.batch(5)
    assert x.shape == y.shape == (4, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, b.batch(5)[0]) and torch.equal(y, b.batch(5)[1])
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y, x + 1)  # arange data: targets are the next tokens
    assert (x[:, 0] % 8 == 0).all()  # windows start at multiples of seq_len
    assert not torch.equal(x, a.batch(6)[0])
    assert not torch.equal(x, Loader(split, 8, 4, seed=4).batch(5)[0])


def test_loader_dp_ranks_union_equals_single():
    split = make_split(2000, shard_tokens=300)
    full = Loader(split, 16, 8, seed=7)
    for step in (0, 3, 40):
        xs, ys = zip(*(Loader(split, 16, 8, seed=7, dp_rank=r, dp_size=2).batch(step) for r in range(2)))
        assert all(x.shape == (4, 16) for x in xs)
        fx, fy = full.batch(step)
        assert torch.equal(torch.cat(xs), fx) and torch.equal(torch.cat(ys), fy)
    with pytest.raises(LowbitError) as e:
        Loader(split, 16, 6, seed=0, dp_size=4)
    one_line_error(e, "6", "4")


def test_loader_epochs():
    split = make_split(8 * 10 + 1)  # exactly 10 windows of seq_len 8
    loader = Loader(split, 8, 3, seed=0)
    assert loader.num_windows == 10
    starts = torch.cat([loader.batch(s)[0][:, 0] for s in range(7)]).tolist()  # 21 samples
    assert sorted(starts[:10]) == sorted(starts[10:20]) == list(range(0, 80, 8))
    assert starts[:10] != starts[10:20]  # a fresh permutation each epoch
    # Batch 3 straddles the boundary: samples 9 (epoch 0) and 10, 11 (epoch 1).
    assert loader.batch(3)[0][:, 0].tolist() == starts[9:12]
    assert loader.epoch_of(0) == 0 and loader.epoch_of(10) == 3.0
    # Resuming is stateless: a fresh loader jumping to step 6 agrees.
    assert torch.equal(Loader(split, 8, 3, seed=0).batch(6)[0], loader.batch(6)[0])


def test_loader_too_few_tokens(tmp_path):
    with pytest.raises(LowbitError) as e:
        Loader(make_split(8), seq_len=8, global_batch=1, seed=0)
    one_line_error(e, "8 tokens", "seq_len+1=9", "data.seq_len")
    f = tmp_path / "tiny.txt"
    f.write_text("hi")
    prepare([f], tmp_path / "ds", vocab_size=300, val_fraction=0.0)
    with pytest.raises(LowbitError) as e:
        Loader(TokenDataset(tmp_path / "ds").split("train"), 64, 1, seed=0)
    one_line_error(e, "train", str(tmp_path / "ds"), "seq_len+1=65")


def test_val_batches():
    split = make_split(8 * 10 + 1)
    batches = val_batches(split, 8, 4, max_batches=2)
    assert [x.shape[0] for x, _ in batches] == [4, 4]
    # 8 of the 10 windows, spread over the split (0 1 2 3 5 6 7 8), not the first 8
    assert torch.cat([x for x, _ in batches])[:, 0].tolist() == [8 * i for i in (0, 1, 2, 3, 5, 6, 7, 8)]
    assert all(torch.equal(x[:, 1:], y[:, :-1]) for x, y in batches)
    everything = val_batches(split, 8, 4, max_batches=100)
    assert [x.shape[0] for x, _ in everything] == [4, 4, 2]
    assert torch.cat([x for x, _ in everything])[:, 0].tolist() == list(range(0, 80, 8))
    assert val_batches(split, 8, 4, max_batches=0) == []


# ---------------------------------------------------------------- builtin corpus, cache, CLI


def test_builtin_corpus_files():
    files = builtin_corpus_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    banned = {"test", "tests", "idle_test", "__pycache__", "site-packages", "dist-packages"}
    assert not any(banned & set(f.parts[len(files[0].parts) - 2 :]) for f in files)
    assert any(f.name == "argparse.py" for f in files)


@pytest.fixture
def small_builtin(monkeypatch, text_dir):
    monkeypatch.setattr(cache_mod, "builtin_corpus_files", lambda: sorted(text_dir.glob("*.txt")))


def test_default_dataset_cached(small_builtin, tmp_path, monkeypatch):
    out = default_dataset(cache_dir=tmp_path / "cache", vocab_size=300)
    assert out.parent == tmp_path / "cache" and out.name.startswith(f"stdlib-py{sys.version_info.major}")
    mtime = (out / "meta.json").stat().st_mtime_ns

    def no_work(*a, **k):
        raise AssertionError("prepared twice")

    monkeypatch.setattr(cache_mod, "prepare", no_work)  # where the cache calls it
    assert default_dataset(cache_dir=tmp_path / "cache", vocab_size=300) == out
    assert (out / "meta.json").stat().st_mtime_ns == mtime
    assert resolve_dataset("", vocab_size=300, cache_dir=tmp_path / "cache") == out
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    assert default_dataset(vocab_size=300) == out


def test_resolve_dataset(text_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    out = resolve_dataset(str(text_dir), vocab_size=300, cache_dir=cache)
    assert out.parent == cache and TokenDataset(out).meta["documents"]["train"] >= 1
    assert resolve_dataset(str(out)) == out  # a prepared directory is used as is
    assert resolve_dataset(str(text_dir), vocab_size=300, cache_dir=cache) == out  # cached
    assert resolve_dataset(str(text_dir), vocab_size=320, cache_dir=cache) != out  # settings are in the key
    (text_dir / "doc0.txt").write_text("changed content\n")
    changed = resolve_dataset(str(text_dir), vocab_size=300, cache_dir=cache)
    assert changed != out and "changed content\n" in split_docs(TokenDataset(changed), "train") + split_docs(
        TokenDataset(changed), "val"
    )
    with pytest.raises(LowbitError) as e:
        resolve_dataset(str(tmp_path / "absent"), cache_dir=cache)
    one_line_error(e, "data path not found")


def test_cli_prepare(text_dir, tmp_path, capsys, small_builtin, monkeypatch):
    parser = argparse.ArgumentParser()
    add_prepare_args(parser)
    out = tmp_path / "cli_out"
    assert run_prepare(parser.parse_args([str(text_dir), "--out", str(out), "--vocab-size", "300"])) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)  # progress lines, then the directory
    assert TokenDataset(out).vocab_size <= 300
    with pytest.raises(LowbitError) as e:
        run_prepare(parser.parse_args([str(text_dir), "--out", str(out), "--vocab-size", "300"]))
    one_line_error(e, "--overwrite")
    assert run_prepare(parser.parse_args([str(text_dir), "--out", str(out), "--vocab-size", "280", "--overwrite"])) == 0
    for bad, flag in ((["--vocab-size", "257"], "--vocab-size"), (["--val-fraction", "1"], "--val-fraction"),
                      (["--val-fraction", "-0.1"], "--val-fraction")):
        with pytest.raises(LowbitError) as e:
            run_prepare(parser.parse_args([str(text_dir), "--out", str(tmp_path / "x"), *bad]))
        one_line_error(e, flag)
    # No INPUT: the builtin corpus (patched small here), into --out or the cache.
    capsys.readouterr()
    monkeypatch.setenv("LOWBIT_CACHE", str(tmp_path / "cache"))
    assert run_prepare(parser.parse_args(["--vocab-size", "300"])) == 0
    printed = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed.parent == tmp_path / "cache" and (printed / "meta.json").is_file()
    assert run_prepare(parser.parse_args(["--out", str(tmp_path / "b"), "--vocab-size", "300"])) == 0
    assert (tmp_path / "b" / "meta.json").is_file()


def test_builtin_split_holds_out_a_tenth_of_the_files_in_a_cache_entry_of_its_own(monkeypatch, tmp_path):
    """The built-in corpus's default split (10% of its files) is prepared into its own cache entry: a dataset
    prepared with another split is never reused as this one."""
    d = tmp_path / "many"
    d.mkdir()
    for i in range(200):
        (d / f"f{i:03d}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i % 7}\n")
    monkeypatch.setattr(cache_mod, "builtin_corpus_files", lambda: sorted(d.glob("*.py")))
    out = default_dataset(cache_dir=tmp_path / "cache", vocab_size=300)
    docs = json.loads((out / "meta.json").read_text())["documents"]
    assert docs["train"] + docs["val"] == 200 and 10 <= docs["val"] <= 30  # ~20 of 200 drawn at 0.1
    assert default_dataset(cache_dir=tmp_path / "cache", vocab_size=300, val_fraction=0.1) == out
    other = default_dataset(cache_dir=tmp_path / "cache", vocab_size=300, val_fraction=0.005)
    assert other != out and json.loads((other / "meta.json").read_text())["documents"]["val"] < docs["val"]
