"""`model.init_from PATH`: the weights a run starts from instead of a random init, the inverse of `export-hf`.

PATH is a HF Llama directory (config.json and safetensors: one file, or shards listed by their index, as export-hf
writes and model hubs hold) or a lowbit run or checkpoint directory (its newest good checkpoint). `check_init`
reads only what describes the weights (config, safetensors headers, trainer.json) and checks it against the
configured model and the data's tokenizer before anything is written; `load_init` reads the weights into the built
model before it is converted, so every recipe and layout starts from them. A resumed run takes its checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from lowbit.errors import LowbitError
from lowbit.models.hf import check_hf_config, lowbit_name
from lowbit.models.llama import Llama, ModelArgs
from lowbit.train import checkpoint as ckpt

# Model args that may differ on resume: how the same function is computed or regularized, not which.
RESUMABLE_CHANGES = ("checkpointing", "dropout", "init_std", "performer_chunk", "performer_redraw", "sdpa_backend")
# ... and from a run's weights: also the rotary table's length (computed, not stored)
INIT_CHANGES = RESUMABLE_CHANGES + ("max_seq_len",)


@dataclass
class InitSource:
    """Checked weights to start from: HF safetensors files (`files`) or a lowbit checkpoint (`checkpoint`)."""

    path: Path
    files: list[Path]
    checkpoint: Path | None = None


def shape_difference(saved: dict, args: ModelArgs, ignore: tuple[str, ...]) -> str | None:
    """The first field other than `ignore` where model args `saved` (a checkpoint's, defaults filled in) differ
    from `args`, as "field X there, Y here"; None if they agree."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelArgs) if f.default is not dataclasses.MISSING}
    saved = {**defaults, **saved}
    for k, v in dataclasses.asdict(args).items():
        if k not in ignore and saved.get(k) != v:
            return f"{k} {saved.get(k)} there, {v} here"
    return None


def check_init(path: str, args: ModelArgs, tokenizer_hash: str) -> InitSource:
    p = Path(path)
    if not p.is_dir():
        raise LowbitError(f"model.init_from: {path} is not a directory (a HF Llama directory or a lowbit run)")
    if (p / "config.json").is_file():
        return _check_hf(p, args, tokenizer_hash)
    if (p / "manifest.json").is_file() or (p / "checkpoints").is_dir():
        found = ckpt.latest_for_inference(p)
        _, info = ckpt.load_state(found)
        difference = shape_difference(info.get("model_args", {}), args, INIT_CHANGES)
        if difference:
            raise LowbitError(f"model.init_from: checkpoint {found} does not fit the configured model: {difference}")
        if info.get("tokenizer_hash") != tokenizer_hash:
            raise LowbitError(f"model.init_from: checkpoint {found} was trained with another tokenizer than the data "
                              f"(prepare the data with --data.tokenizer {p / 'tokenizer.json'})")
        return InitSource(p, [], found)
    raise LowbitError(f"model.init_from: {path} is neither a HF Llama directory (config.json and safetensors) nor a "
                      f"lowbit run or checkpoint directory")


def _safetensors_files(p: Path) -> list[Path]:
    index = p / "model.safetensors.index.json"
    try:
        files = sorted({p / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.is_file() \
            else sorted(p.glob("*.safetensors"))
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise LowbitError(f"model.init_from: {index} cannot be read ({e})") from None
    if not files:
        raise LowbitError(f"model.init_from: {p} has config.json but no .safetensors weights")
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise LowbitError(f"model.init_from: {missing[0]} is listed in {index.name} but missing")
    return files


def _check_hf(p: Path, args: ModelArgs, tokenizer_hash: str) -> InitSource:
    """config.json against the model, every safetensors tensor's name and shape against its parameters (read from
    the headers: no weight is loaded), the tokenizer beside them (if any) against the data's."""
    try:
        config = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise LowbitError(f"model.init_from: {p / 'config.json'} cannot be read ({e})") from None
    check_hf_config(config, args, str(p))
    files = _safetensors_files(p)
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Llama(args).named_parameters()}
    seen = set()
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    name = lowbit_name(key)
                    if name is None or (name == "output.weight" and args.tie_embeddings):  # a tied head's copy
                        continue
                    shape = tuple(st.get_slice(key).get_shape())
                    if name not in expected or shape != expected[name]:
                        raise LowbitError(f"model.init_from: {f.name} holds {key} {list(shape)}, the configured model "
                                          f"{'has no such weight' if name not in expected else list(expected[name])}")
                    seen.add(name)
        except (OSError, RuntimeError) as e:  # safetensors' own errors derive from these
            raise LowbitError(f"model.init_from: {f} cannot be read ({str(e).splitlines()[0]})") from None
    missing = sorted(set(expected) - seen)
    if missing:
        raise LowbitError(f"model.init_from: {p} has no weight for {missing[0]} (of {len(missing)} missing)")
    tok = p / "tokenizer.json"
    if tok.is_file():
        from lowbit.data import load_tokenizer, tokenizer_hash as hash_of

        if hash_of(load_tokenizer(tok)) != tokenizer_hash:
            raise LowbitError(f"model.init_from: {tok} is not the data's tokenizer (prepare the data with "
                              f"--data.tokenizer {tok})")
    return InitSource(p, files)


@torch.no_grad()
def load_init(source: InitSource, model: Llama) -> None:
    """The checked weights into `model` (plain, not yet converted), each in its parameter's dtype and device."""
    if source.checkpoint is not None:
        state, _ = ckpt.load_model_weights(source.checkpoint)
        state = {k: v for k, v in state.items() if ".scaling." not in k}
    else:
        state = {}
        for f in source.files:
            with safe_open(str(f), "pt") as st:
                state.update({name: st.get_tensor(key) for key in st.keys() if (name := lowbit_name(key))})
    params = dict(model.named_parameters())
    for name, p in params.items():
        p.copy_(state[name].to(p.dtype))
    buffers = dict(model.named_buffers())
    for name, t in state.items():  # persistent buffers a run saved (performer features)
        if name not in params and name in buffers:
            buffers[name].copy_(t.to(buffers[name].dtype))
