"""`lowbit generate RUN_DIR`: sample text from a run's newest good checkpoint (or a checkpoint dir)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lowbit.errors import LowbitError
from lowbit.models.llama import Llama, ModelArgs
from lowbit.train import checkpoint as ckpt


def load_trained(run_dir: str) -> tuple[Llama, Path, dict]:
    """(plain model in eval mode on CPU, tokenizer.json path, checkpoint info) of a run dir or checkpoint dir."""
    path = ckpt.latest_for_inference(run_dir)
    state, info = ckpt.load_model_weights(path)
    model = Llama(ModelArgs(**info["model_args"]))
    # The high-precision weights are the model; a recipe's scaling buffers describe training, not inference.
    model.load_state_dict({k: v for k, v in state.items() if ".scaling." not in k})
    model.eval()
    for candidate in (path / "tokenizer.json", path.parent.parent / "tokenizer.json"):
        if candidate.is_file():
            return model, candidate, info
    raise LowbitError(f"no tokenizer.json beside checkpoint {path} (expected in the run directory)")


def run_eos_token(tok_path: Path) -> str:
    """The data.eos_token of the run whose tokenizer this is ("" if unset or not a run's)."""
    config = tok_path.parent / "config.toml"
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        return str(tomllib.loads(config.read_text()).get("data", {}).get("eos_token", ""))
    except (OSError, ValueError):
        return ""


@torch.no_grad()
def sample(model: Llama, ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
           generator: torch.Generator, stop_id: int | None = None) -> list[int]:
    """Autoregressive sampling; the context is cropped to max_seq_len (no KV cache: a tool, not a server)."""
    out = list(ids)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-model.args.max_seq_len:]])
        logits = model(context)[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits[logits < kth] = -float("inf")
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        out.append(nxt)
        if stop_id is not None and nxt == stop_id:
            break
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory (its newest good checkpoint) or a checkpoint directory")
    p.add_argument("--prompt", default="", help="text to continue (default: start from end-of-text)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="0: no top-k filtering")
    p.add_argument("--seed", type=int, default=0)


def run(a: argparse.Namespace) -> int:
    from lowbit.data import eos_id, load_tokenizer

    if a.max_new_tokens <= 0:
        raise LowbitError(f"--max-new-tokens: must be > 0, got {a.max_new_tokens}")
    if a.temperature < 0:
        raise LowbitError(f"--temperature: must be >= 0, got {a.temperature}")
    model, tok_path, info = load_trained(a.run_dir)
    name = run_eos_token(tok_path)
    tok = load_tokenizer(tok_path, name)
    eos = eos_id(tok, name)
    ids = tok.encode(a.prompt).ids if a.prompt else [eos]
    g = torch.Generator().manual_seed(a.seed)
    out = sample(model, ids, a.max_new_tokens, a.temperature, a.top_k, g, stop_id=eos)
    start = 0 if a.prompt else 1
    print(tok.decode(out[start:]))
    return 0
