"""HF transformers' LlamaForCausalLM beside lowbit's Llama: the weight names both ways and the config both ways.
lowbit's weights follow HF's layout (rotate-half RoPE, separate projections), so moving between the two is a
renaming; `lowbit export-hf` writes with it and `model.init_from` reads with it."""

from __future__ import annotations

import torch

from lowbit.errors import LowbitError
from lowbit.models.llama import ModelArgs

# lowbit name -> HF name, per block
BLOCK_NAMES = {
    "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj", "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
# HF config key -> ModelArgs field: what must agree for HF's weights to be this model's
CONFIG_FIELDS = {"hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
                 "num_key_value_heads": "n_kv_heads", "intermediate_size": "ffn_dim", "vocab_size": "vocab_size",
                 "rope_theta": "rope_theta", "rms_norm_eps": "norm_eps", "tie_word_embeddings": "tie_embeddings",
                 "head_dim": "head_dim"}


def hf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        module, leaf = rest.rsplit(".", 1)
        if module in BLOCK_NAMES:
            return f"model.layers.{i}.{BLOCK_NAMES[module]}.{leaf}"
    raise LowbitError(f"export-hf: parameter {name} has no HF LlamaForCausalLM counterpart")


def lowbit_name(name: str) -> str | None:
    """The lowbit name of a HF LlamaForCausalLM weight, None for one that is not a weight of the model (the
    rotary inverse frequencies older checkpoints hold)."""
    top = {v: k for k, v in _TOP.items()}
    if name in top:
        return top[name]
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        module, leaf = rest.rsplit(".", 1)
        inverse = {v: k for k, v in BLOCK_NAMES.items()}
        if module in inverse:
            return f"layers.{i}.{inverse[module]}.{leaf}"
        if module.endswith("rotary_emb"):
            return None
    raise LowbitError(f"model.init_from: weight {name} has no lowbit Llama counterpart (a LlamaForCausalLM "
                      f"without biases is what lowbit reads)")


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under HF's names, contiguous on the CPU."""
    return {hf_name(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}


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


def check_hf_config(config: dict, a: ModelArgs, where: str) -> None:
    """HF config.json `config` describes the model `a`: the same shape and the same function (RoPE base, norm
    epsilon), no biases, no RoPE scaling; else a one-line error naming the first difference."""
    if config.get("model_type", "llama") != "llama":
        raise LowbitError(f"model.init_from: {where} holds a {config.get('model_type')!r} model, not a llama")
    for key, value in (("attention_bias", False), ("mlp_bias", False), ("rope_scaling", None),
                       ("hidden_act", "silu")):
        if config.get(key, value) != value:
            raise LowbitError(f"model.init_from: {where} has {key} {config[key]!r}, which lowbit's Llama has not "
                              f"(it needs {value!r})")
    defaults = {"num_key_value_heads": config.get("num_attention_heads"), "tie_word_embeddings": False,
                "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
                "head_dim": (config.get("hidden_size") or 0) // (config.get("num_attention_heads") or 1)}
    for key, field in CONFIG_FIELDS.items():
        theirs, ours = config.get(key, defaults.get(key)), getattr(a, field)
        same = abs(float(theirs) - float(ours)) <= 1e-12 * abs(float(ours)) if isinstance(ours, float) \
            and isinstance(theirs, (int, float)) else theirs == ours
        if not same:
            flag = "model.dim / model.n_heads" if field == "head_dim" else f"model.{field}"
            fix = "set model.dim and model.n_heads" if field == "head_dim" else f"set --{flag} {theirs}"
            raise LowbitError(f"model.init_from: {where} has {key} {theirs}, the configured model has {flag} {ours}: "
                              f"{fix} (or a model.preset that matches)")
