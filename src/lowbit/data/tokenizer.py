"""Byte-level BPE tokenizers: train, load, identify."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from lowbit.errors import LowbitError

EOS_TOKEN = "<|endoftext|>"
# Accepted when a tokenizer made elsewhere lacks EOS_TOKEN (LLaMA/T5-style names).
_EOS_FALLBACKS = (EOS_TOKEN, "</s>", "<eos>")
_MIN_VOCAB = 256 + 1  # every byte plus EOS


def train_tokenizer(texts: Iterable[str], vocab_size: int, eos_token: str = "") -> Tokenizer:
    """Train a byte-level BPE whose id 0 is the EOS token (EOS_TOKEN unless named); any byte string stays
    encodable."""
    if not isinstance(vocab_size, int) or vocab_size <= _MIN_VOCAB:
        raise LowbitError(
            f"data.vocab_size = {vocab_size!r} is too small: "
            f"byte-level BPE needs more than {_MIN_VOCAB} (256 bytes + EOS)"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[eos_token or EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def load_tokenizer(path: str | Path, eos_token: str = "") -> Tokenizer:
    """Load a tokenizer.json file, or the tokenizer.json inside a directory; it must have an EOS token
    (`eos_token`, else one of the usual names)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise LowbitError(f"tokenizer not found: {file}")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LowbitError(f"tokenizer {file} is unreadable: {first_line}") from None
    eos_id(tok, eos_token, where=str(file))
    return tok


def eos_id(tok: Tokenizer, eos_token: str = "", *, where: str = "") -> int:
    """Id of the end-of-document token: `eos_token` if named, else EOS_TOKEN, else "</s>", else "<eos>"."""
    label = f"tokenizer {where}" if where else "tokenizer"
    if eos_token:
        i = tok.token_to_id(eos_token)
        if i is None:
            raise LowbitError(f"{label} has no token {eos_token!r} (data.eos_token / --eos-token)")
        return i
    for name in _EOS_FALLBACKS:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise LowbitError(f"{label} has no end-of-document token (looked for {', '.join(_EOS_FALLBACKS)}); "
                      f"name it with data.eos_token / --eos-token")


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 of the canonical JSON: identifies a tokenizer regardless of file formatting."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()
