"""`lowbit export-hf RUN_DIR OUT_DIR`: a HF transformers LlamaForCausalLM directory (config.json,
model.safetensors, tokenizer files) from a run's newest good checkpoint."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from lowbit.errors import LowbitError
from lowbit.models.hf import hf_config, hf_state_dict


def export(run_dir: str, out_dir: str) -> Path:
    from lowbit.data import EOS_TOKEN, eos_id, load_tokenizer
    from lowbit.tools.generate import load_trained, run_eos_token

    model, tok_path, _ = load_trained(run_dir)
    if model.args.attention != "sdpa":
        raise LowbitError(f"export-hf: {run_dir} uses {model.args.attention} attention, which LlamaForCausalLM "
                          f"does not have (its weights would compute something else there)")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LowbitError(f"export-hf: output path {out} is a file, not a directory")
    if out.exists() and any(out.iterdir()):
        raise LowbitError(f"export-hf: output directory {out} is not empty")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LowbitError(f"export-hf: cannot create {out} ({e.strerror or e})") from None
    name = run_eos_token(tok_path)
    tok = load_tokenizer(tok_path, name)
    eos = eos_id(tok, name)
    eos_text = tok.id_to_token(eos) or EOS_TOKEN
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.args, eos), indent=1))
    shutil.copyfile(tok_path, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": eos_text, "eos_token": eos_text,
        "unk_token": eos_text, "model_max_length": model.args.max_seq_len, "clean_up_tokenization_spaces": False,
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": eos, "eos_token_id": eos}, indent=1))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="run directory (its newest good checkpoint) or a checkpoint directory")
    p.add_argument("out_dir", help="empty or new directory for the HF model")


def run(a: argparse.Namespace) -> int:
    print(export(a.run_dir, a.out_dir))
    return 0
