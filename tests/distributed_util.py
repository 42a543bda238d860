"""Run a function in N processes (spawned, gloo on CPU) and collect what each returns."""

import os
import socket
import tempfile
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, out, args, env):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **env)
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out, f"{rank}.pt"))  # before teardown: the work is done and checked from here on
    except BaseException:  # the parent reports it
        Path(out, f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(world: int, fn, *args, timeout: float = 300, env: dict | None = None) -> list:
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args, env or {})) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [Path(out, f"{r}.err").read_text() for r in range(world) if Path(out, f"{r}.err").exists()]
        done = [Path(out, f"{r}.pt").exists() for r in range(world)]
        # A rank killed by a signal after it saved its result died in teardown (seen once under load: gloo's
        # "terminate called without an active exception", SIGABRT): reported, not failed. Anything else fails.
        codes = [p.exitcode for p in procs]
        if errors or any(c != 0 and not (c is not None and c < 0 and d) for c, d in zip(codes, done)):
            raise AssertionError(f"ranks failed (exit codes {codes}):\n" + "\n".join(errors))
        if any(c != 0 for c in codes):
            warnings.warn(f"ranks exited with {codes} in teardown, after their results were saved")
        return [torch.load(Path(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def init_gloo():
    dist.init_process_group("gloo")
