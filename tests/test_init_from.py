"""`model.init_from`: a run starts from a HF Llama directory or a lowbit run, the inverse of export-hf: identical
logits to the weights it read, and every mismatch with the configured model one line before anything is written."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from conftest import SMALL, assert_user_error, cli, losses, snapshot
from lowbit.errors import LowbitError
from lowbit.models.hf import hf_config, hf_state_dict
from lowbit.models.llama import Llama, ModelArgs
from lowbit.train.init_from import check_init, load_init

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=320, max_seq_len=64)


def _hf_dir(path, args=ARGS, drop=(), extra=None):
    """A HF Llama directory as export-hf writes one (no tokenizer), from a lowbit model of `args`."""
    torch.manual_seed(0)
    model = Llama(args)
    state = {k: v for k, v in hf_state_dict(model).items() if k not in drop}
    path.mkdir()
    save_file({**state, **(extra or {})}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config(args, 0)))
    return model


def test_hf_directory_loads_with_identical_logits(tmp_path):
    ref = _hf_dir(tmp_path / "hf").eval()
    torch.manual_seed(1)
    model = Llama(ARGS).eval()  # another init, overwritten
    load_init(check_init(str(tmp_path / "hf"), ARGS, "any"), model)
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def test_hf_shards_with_an_index_and_a_tied_head(tmp_path):
    args = dataclasses.replace(ARGS, tie_embeddings=True)
    torch.manual_seed(0)
    ref = Llama(args).eval()
    state = hf_state_dict(ref)
    (tmp_path / "hf").mkdir()
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / "hf" / f))
    index = {"weight_map": {k: f for f, keys in halves.items() for k in keys}}
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config(args, 0)))
    model = Llama(args).eval()
    load_init(check_init(str(tmp_path / "hf"), args, "any"), model)
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


@pytest.mark.parametrize("args,needle", [
    (dataclasses.replace(ARGS, dim=32), "has hidden_size 64, the configured model has model.dim 32"),
    (dataclasses.replace(ARGS, n_layers=3), "has num_hidden_layers 2, the configured model has model.n_layers 3"),
    (dataclasses.replace(ARGS, vocab_size=384), "has vocab_size 320, the configured model has model.vocab_size 384"),
    (dataclasses.replace(ARGS, rope_theta=500.0), "has rope_theta 10000.0"),
    (dataclasses.replace(ARGS, tie_embeddings=True), "has tie_word_embeddings False"),
])
def test_hf_config_mismatch_is_one_line(tmp_path, args, needle):
    _hf_dir(tmp_path / "hf")
    with pytest.raises(LowbitError, match=needle) as e:
        check_init(str(tmp_path / "hf"), args, "any")
    assert "\n" not in str(e.value)


def test_hf_weights_that_do_not_fit_are_named(tmp_path):
    _hf_dir(tmp_path / "missing", drop=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(LowbitError, match="has no weight for layers.1.feed_forward.w2.weight"):
        check_init(str(tmp_path / "missing"), ARGS, "any")
    _hf_dir(tmp_path / "bias", extra={"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    with pytest.raises(LowbitError, match=r"q_proj.bias \[64\], the configured model has no such weight"):
        check_init(str(tmp_path / "bias"), ARGS, "any")
    _hf_dir(tmp_path / "shape", extra={"model.norm.weight": torch.zeros(65)})
    with pytest.raises(LowbitError, match=r"holds model.norm.weight \[65\], the configured model \[64\]"):
        check_init(str(tmp_path / "shape"), ARGS, "any")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LowbitError, match="neither a HF Llama directory"):
        check_init(str(tmp_path / "empty"), ARGS, "any")
    with pytest.raises(LowbitError, match="is not a directory"):
        check_init(str(tmp_path / "nowhere"), ARGS, "any")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(hf_config(ARGS, 0)))
    with pytest.raises(LowbitError, match="no .safetensors weights"):
        check_init(str(tmp_path / "noweights"), ARGS, "any")
    config = {**hf_config(ARGS, 0), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LowbitError, match="has rope_scaling"):
        check_init(str(tmp_path / "noweights"), ARGS, "any")


@pytest.mark.slow
def test_train_export_init_from_round_trip(tmp_path, capsys):
    """Train briefly, export to HF, start runs from the export and from the run: the weights they start from give
    the trained model's logits exactly, and both runs take the same first step."""
    from lowbit.tools.generate import load_trained

    run = tmp_path / "run"
    assert cli(capsys, "train", *SMALL, "--train.steps", "3", "--run.dir", run)[0] == 0
    assert cli(capsys, "export-hf", run, tmp_path / "hf")[0] == 0
    trained, _, info = load_trained(str(run))
    from lowbit.data import load_tokenizer, tokenizer_hash

    tok_hash = tokenizer_hash(load_tokenizer(run / "tokenizer.json"))
    x = torch.randint(0, trained.args.vocab_size, (2, 32))
    for source in (tmp_path / "hf", run):
        model = Llama(trained.args).eval()
        load_init(check_init(str(source), trained.args, tok_hash), model)
        with torch.no_grad():
            assert torch.equal(model(x), trained(x)), source
    firsts = {}
    for name, source in (("from-hf", tmp_path / "hf"), ("from-run", run)):
        assert cli(capsys, "train", *SMALL, "--train.steps", "1", "--model.init_from", source,
                   "--run.dir", tmp_path / name)[0] == 0
        firsts[name] = losses(tmp_path / name)[1]
    assert firsts["from-hf"] == firsts["from-run"]
    assert firsts["from-hf"] < losses(run)[1] - 0.1  # not a fresh init: it starts where the run ended
    before = snapshot(tmp_path)
    assert_user_error(capsys, ["train", *SMALL, "--model.dim", "32", "--model.init_from", tmp_path / "hf",
                               "--run.dir", tmp_path / "bad"], "model.init_from", "hidden_size 64", "model.dim 32")
    assert snapshot(tmp_path) == before and not (tmp_path / "bad").exists()
