"""`lowbit prepare`: arguments and entry point (the top-level CLI wires these in)."""

from __future__ import annotations

import argparse
import sysconfig

from lowbit.data import cache  # module, not names: tests swap cache.builtin_corpus_files
from lowbit.data.prepare import prepare
from lowbit.errors import LowbitError

_DEFAULT_VOCAB = 8192  # for user corpora, as prepare(); the builtin corpus defaults to 4096, as the trainer
_BUILTIN_VOCAB = 4096


def add_prepare_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs", nargs="*", metavar="INPUT",
        help="text files, .jsonl, .parquet or directories of them; none: the Python standard library",
    )
    parser.add_argument("--out", default="", metavar="DIR", help="output directory (default: the lowbit cache)")
    parser.add_argument(
        "--tokenizer", default="", metavar="PATH", help="use this tokenizer.json instead of training one"
    )
    parser.add_argument(
        "--vocab-size", type=int, default=None, metavar="N",
        help=f"vocabulary of the trained tokenizer (default {_DEFAULT_VOCAB}; {_BUILTIN_VOCAB} for the builtin corpus)",
    )
    parser.add_argument("--field", default="text", metavar="F", help="JSON key holding the text in .jsonl files")
    parser.add_argument("--column", default="text", metavar="C", help="column holding the text in .parquet files")
    parser.add_argument("--val-fraction", type=float, default=None, metavar="X",
                        help="share of documents held out (default 0.005; 0.1 for the builtin corpus)")
    parser.add_argument("--eos-token", default="", metavar="T",
                        help="the end-of-document token (default: <|endoftext|>, </s> or <eos>, found in the tokenizer)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the train/validation split")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing dataset in --out")


def run_prepare(args: argparse.Namespace) -> int:
    """Prepare, then print the dataset directory as the last line on stdout."""

    if args.vocab_size is not None and args.vocab_size <= 257:
        raise LowbitError(f"--vocab-size {args.vocab_size} is too small: it must be > 257 (256 bytes + EOS)")
    if args.val_fraction is not None and not 0 <= args.val_fraction < 1:
        raise LowbitError(f"--val-fraction {args.val_fraction} must be in [0, 1)")
    vocab = args.vocab_size or (_DEFAULT_VOCAB if args.inputs else _BUILTIN_VOCAB)
    if args.out:
        fraction = args.val_fraction
        if fraction is None:
            fraction = cache.VAL_FRACTION if args.inputs else cache.BUILTIN_VAL_FRACTION
        prepare(
            args.inputs or cache.builtin_corpus_files(), args.out, tokenizer=args.tokenizer or None,
            vocab_size=vocab, field=args.field, column=args.column, val_fraction=fraction,
            seed=args.seed, overwrite=args.overwrite, eos_token=args.eos_token,
            sources=None if args.inputs else [sysconfig.get_paths()["stdlib"]],
        )
        out = args.out
    elif args.inputs:
        out = cache.prepare_cached(
            args.inputs, tokenizer=args.tokenizer, vocab_size=vocab, field=args.field,
            column=args.column, val_fraction=args.val_fraction, seed=args.seed, eos_token=args.eos_token,
        )
    else:
        # The cache entry the trainer uses when data.path is empty; its split seed is fixed.
        if args.seed != 0:
            raise LowbitError("--seed needs --out or INPUT: the cached builtin dataset always uses seed 0")
        out = cache.default_dataset(vocab_size=vocab, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                                    eos_token=args.eos_token)
    print(out)
    return 0
