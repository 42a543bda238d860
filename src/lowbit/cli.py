"""`lowbit <command>`: train, prepare, generate, export-hf, recipes, inspect, compare, bench. User errors print
one line and exit with status 2."""

from __future__ import annotations

import argparse
import shlex
import sys

from lowbit.errors import LowbitError

USAGE = """usage: lowbit <command> [options]

commands:
  train [CONFIG.toml] [--section.key=value ...]   pretrain (no arguments: tiny preset on the built-in corpus)
  prepare [INPUT ...] [--out DIR] [...]           tokenize text/.jsonl/.parquet into token shards
  generate RUN_DIR [--prompt TEXT] [...]          sample text from a run's newest checkpoint
  export-hf RUN_DIR OUT_DIR                       write a HF transformers LlamaForCausalLM directory
  recipes                                         list the numerics recipes
  inspect RUN_DIR                                 numerics telemetry: heatmaps and the worst layers
  compare --recipes A,B,... [--out DIR] [--devices D,...] [CONFIG.toml] [--section.key=value ...]
                                                  train under each recipe, then losses, gaps and telemetry side by side
  bench {gemm,linear,mlp,block,step,memory} [...]  bf16 vs lowbit recipes vs torchao float8: tables + JSON

`lowbit <command> --help` lists a command's options."""


def _train(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        from lowbit.train.config import help_text

        print("usage: lowbit train [CONFIG.toml] [--section.key=value | --section.key value ...]\n")
        print(help_text())
        return 0
    from lowbit.train.plan import load_config

    path = None
    if argv and not argv[0].startswith("--"):
        path, argv = argv[0], argv[1:]
    cfg = load_config(path, argv)
    from lowbit.distributed.mesh import shutdown
    from lowbit.train.trainer import train

    train(cfg)
    shutdown()  # only on success: after an error the other ranks may still be inside a collective
    return 0


def _subcommand(name: str, argv: list[str]) -> int:
    if name == "prepare":
        from lowbit.data import add_prepare_args as add, run_prepare as run
    elif name == "generate":
        from lowbit.tools.generate import add_args as add, run
    elif name == "inspect":
        from lowbit.tools.inspect import add_args as add, run
    elif name == "compare":
        from lowbit.tools.compare import add_args as add, run
    elif name == "bench":
        from lowbit.tools.bench import add_args as add, run
    else:
        from lowbit.tools.export_hf import add_args as add, run
    parser = _Parser(prog=f"lowbit {name}")
    add(parser)
    if name == "compare":  # what its parser does not know is train's: CONFIG.toml and --section.key=value
        a, a.train = parser.parse_known_args(argv)
        a.command = shlex.join(["lowbit", name, *argv])
        return run(a)
    args = parser.parse_args(argv)
    args.argv = [name, *argv]  # the command as given (`lowbit bench` prints it with its figures)
    return run(args)


def _recipes() -> int:
    from lowbit.numerics.recipes import RECIPES

    for r in RECIPES.values():
        print(f"{r.name:<16} {r.description}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are LowbitErrors (one line, exit 2) like every other user error."""

    def error(self, message: str):
        raise LowbitError(f"{self.prog}: {message}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    try:
        if command == "train":
            return _train(rest)
        if command in ("prepare", "generate", "export-hf", "inspect", "compare", "bench"):
            return _subcommand(command, rest)
        if command == "recipes":
            return _recipes()
        if command in ("-V", "--version"):
            from lowbit import __version__

            print(__version__)
            return 0
        raise LowbitError(f"unknown command {command!r} (train, prepare, generate, export-hf, recipes, inspect, "
                          "compare, bench)")
    except LowbitError as e:
        print(f"lowbit: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("lowbit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
