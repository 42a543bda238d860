"""Data pipeline: raw text -> tokenizer + token shards (prepare), shards -> batches (dataset, loader)."""

from lowbit.data.dataset import TokenDataset, TokenSplit
from lowbit.data.loader import Loader, val_batches
from lowbit.data.cache import builtin_corpus_files, default_dataset, resolve_dataset
from lowbit.data.cli import add_prepare_args, run_prepare
from lowbit.data.documents import read_documents
from lowbit.data.prepare import prepare
from lowbit.data.shards import token_dtype
from lowbit.data.tokenizer import EOS_TOKEN, eos_id, load_tokenizer, tokenizer_hash, train_tokenizer

__all__ = [
    "EOS_TOKEN",
    "Loader",
    "TokenDataset",
    "TokenSplit",
    "add_prepare_args",
    "builtin_corpus_files",
    "default_dataset",
    "eos_id",
    "load_tokenizer",
    "prepare",
    "read_documents",
    "resolve_dataset",
    "run_prepare",
    "token_dtype",
    "tokenizer_hash",
    "train_tokenizer",
    "val_batches",
]
