"""`lowbit export-hf RUN_DIR OUT_DIR`: a HF transformers LlamaForCausalLM directory (config.json,
model.safetensors, tokenizer files) from a run's newest good checkpoint."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from lowbit.errors import LowbitError
from lowbit.models.llama import Llama, ModelArgs

# lowbit name -> HF name, per block
_BLOCK = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}


def hf_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in model.state_dict().items():
        if name == "tok_embeddings.weight":
            out["model.embed_tokens.weight"] = t
        elif name == "norm.weight":
            out["model.norm.weight"] = t
        elif name == "output.weight":
            out["lm_head.weight"] = t
        elif name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            module, leaf = rest.rsplit(".", 1)
            out[f"model.layers.{i}.{_BLOCK[module]}.{leaf}"] = t
        else:
            raise LowbitError(f"export-hf: parameter {name} has no HF LlamaForCausalLM counterpart")
    return {k: v.detach().contiguous().cpu() for k, v in out.items()}


def hf_config(a: ModelArgs, eos: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": a.dim,
        "intermediate_size": a.ffn_dim, "num_hidden_layers": a.n_layers, "num_attention_heads": a.n_heads,
        "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim, "vocab_size": a.vocab_size,
        "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta,
        "tie_word_embeddings": a.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "initializer_range": a.init_std, "bos_token_id": eos, "eos_token_id": eos,
        "torch_dtype": "float32",
    }


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
