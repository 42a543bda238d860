"""lowbit as a library: `lowbit.convert / optimizer / unconvert / plain_state_dict / telemetry` on a module tree of
the user's own and on HF's LlamaForCausalLM, trained in a loop of the user's own; filters found by structure."""

import copy
import subprocess
import sys

import pytest
import torch
from torch import nn

import lowbit
from lowbit.errors import LowbitError
from lowbit.numerics.recipes import find_blocks

VOCAB, DIM = 64, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    """A user's model: lowbit knows none of its names (`stack`, `unembed`)."""

    def __init__(self, n=4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.stack = nn.Sequential(*[Block() for _ in range(n)])
        self.unembed = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x, y=None):
        logits = self.unembed(self.stack(self.embed(x)))
        return logits if y is None else nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _net(seed=0, n=4):
    torch.manual_seed(seed)
    return Net(n)


def test_import_lowbit_stays_light_and_exports_the_library():
    subprocess.run([sys.executable, "-c", "import sys, lowbit; assert 'torch' not in sys.modules"], check=True)
    assert {"convert", "optimizer", "unconvert", "plain_state_dict", "telemetry"} <= set(dir(lowbit))
    with pytest.raises(AttributeError):
        lowbit.no_such_name


def test_filters_find_blocks_and_head_by_structure():
    model = _net()
    report = lowbit.convert(model, "fp8-tensorwise", keep_first_last=True)
    assert sorted(report["converted"]) == ["stack.1.down", "stack.1.up", "stack.2.down", "stack.2.up"]
    assert "unembed (output head)" in report["kept"] and "stack.3.up (first/last block)" in report["kept"]
    report = lowbit.convert(_net(), "fp8-tensorwise", keep_lm_head=False, keep=["stack.0.*"],
                            filter=lambda module, name: not name.endswith("up"))
    assert report["converted"] == ["stack.1.down", "stack.2.down", "stack.3.down", "unembed"]
    assert "stack.1.up (filter)" in report["kept"] and "stack.0.down (keep stack.0.*)" in report["kept"]
    report = lowbit.convert(_net(), "fp8-tensorwise", min_dim=33)  # min(in, out) of each: 32 < 33
    assert report["converted"] == []
    with pytest.raises(LowbitError, match="keep_first_last: this model has no repeated blocks"):
        lowbit.convert(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), "fp8-tensorwise", keep_first_last=True)
    with pytest.raises(LowbitError, match="keep_frst_last: not a module filter"):
        lowbit.convert(_net(), "fp8-tensorwise", keep_frst_last=True)
    with pytest.raises(LowbitError, match="recipe: 'fp9'"):
        lowbit.convert(_net(), "fp9")


def test_blocks_are_the_list_holding_most_parameters():
    """A list of experts inside each block is longer than the list of blocks, but holds fewer parameters."""

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(8))

    model = nn.Module()
    model.layers = nn.ModuleList(MoE() for _ in range(3))
    model.head = nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU())  # mixed types: not blocks
    assert find_blocks(model) == ("layers", 3)
    report = lowbit.convert(model, "fp8-tensorwise", keep_first_last=True)
    assert len(report["converted"]) == 8 + 1 and all(n.startswith(("layers.1.", "head.")) for n in report["converted"])


def counting(n: int, length: int, g: torch.Generator) -> torch.Tensor:
    """Sequences that count up from a random token (mod VOCAB): learnable in a few steps."""
    return (torch.randint(0, VOCAB, (n, 1), generator=g) + torch.arange(length)) % VOCAB


def _steps(model, opt, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        x = counting(4, 17, g)
        loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_custom_module_trains_in_a_user_loop_and_unconverts_to_plain():
    model = _net()
    lowbit.convert(model, "fp8lm-o2", keep_first_last=True)
    opt = lowbit.optimizer(model, "fp8lm-o2", lr=1e-2, weight_decay=0.0)
    covered = [g for g in opt.param_groups if g["covered"]]
    assert len(covered) == 1 and len(covered[0]["params"]) == 4  # blocks 1 and 2's linears
    assert covered[0]["precision"]["exp_avg"] == "e4m3"
    with torch.autocast("cpu", dtype=torch.bfloat16):  # FP16 weights (O2) are bf16 to the model: autocast
        losses = _steps(model, opt, n=8)
    assert losses[-1] < losses[0]
    with lowbit.telemetry(model) as tel:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)).backward()
    assert sorted(tel) == ["stack.1.down", "stack.1.up", "stack.2.down", "stack.2.up"]
    assert set(tel["stack.1.up"]) == {"input", "weight", "grad_output"} and tel["stack.1.up"]["input"]["snr_db"] > 10
    assert not any(m.telemetry_armed for m in model.modules() if isinstance(m, lowbit.LowPrecisionLinear))
    x = torch.randint(0, VOCAB, (2, 16))
    plain = lowbit.plain_state_dict(model)
    assert not any("scaling" in k for k in plain)
    fresh = _net(seed=5)
    fresh.load_state_dict(plain)  # strict: exactly the plain model's keys
    lowbit.unconvert(model)
    assert not any(isinstance(m, lowbit.LowPrecisionLinear) for m in model.modules())
    assert set(model.state_dict()) == set(Net().state_dict())
    assert all(type(p) is nn.Parameter for p in model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), fresh(x))


def test_optimizer_refuses_an_unconverted_model_and_unknown_settings():
    with pytest.raises(LowbitError, match=r"call lowbit.convert\(model, 'fp8lm-o2'\) first"):
        lowbit.optimizer(_net(), "fp8lm-o2")
    model = _net()
    lowbit.convert(model, "fp8-tensorwise")
    with pytest.raises(LowbitError, match="learning_rate: not an optimizer setting"):
        lowbit.optimizer(model, "fp8-tensorwise", learning_rate=1e-3)
    # bf16 converts nothing: the filters choose the weights that get [optim]-style storage
    groups = lowbit.optimizer(_net(), lowbit.get_recipe("bf16"), keep_first_last=True).param_groups
    assert [len(g["params"]) for g in groups if g["covered"]] == [4]


def test_optimizer_groups_as_the_trainer_does():
    """One implementation: the trainer's build_optimizer groups as lowbit.optimizer does."""
    from lowbit.train.config import Config
    from lowbit.train.trainer import build_optimizer

    a, b = _net(), _net()
    recipe = lowbit.recipe_with("fp8lm-o1", keep_first_last=True)
    lowbit.convert(a, recipe)
    lowbit.convert(b, recipe)
    cfg = Config()
    t = cfg.train
    ours = lowbit.optimizer(a, recipe, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay)
    theirs = build_optimizer(b, recipe, recipe.optim, cfg)
    assert [{k: v for k, v in g.items() if k not in ("params", "cuda_graphs")} for g in ours.param_groups] == \
           [{k: v for k, v in g.items() if k not in ("params", "cuda_graphs")} for g in theirs.param_groups]
    assert [len(g["params"]) for g in ours.param_groups] == [len(g["params"]) for g in theirs.param_groups] == [4, 6]


def _hf_config(transformers):
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    tie_word_embeddings=False)


@pytest.mark.slow
def test_hf_llama_converts_trains_and_saves_as_plain_hf(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(_hf_config(transformers))
    report = lowbit.convert(hf, "fp8lm-o2", keep_first_last=True)
    assert report["converted"] and all(n.startswith("model.layers.1.") for n in report["converted"])
    assert "lm_head (output head)" in report["kept"]
    assert "model.layers.2.mlp.down_proj (first/last block)" in report["kept"]
    opt = lowbit.optimizer(hf, "fp8lm-o2", lr=1e-2)
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(6):
        x = counting(4, 32, g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = hf(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert any("scaling" in k for k in hf.state_dict())
    lowbit.unconvert(hf)
    hf.save_pretrained(tmp_path)
    back, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    x = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert torch.equal(hf.eval()(x).logits, back.eval()(x).logits)


@pytest.mark.slow
def test_hf_plain_state_dict_loads_strictly_with_identical_logits():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(_hf_config(transformers))
    converted = copy.deepcopy(hf)
    lowbit.convert(converted, "fp8-tensorwise", filter=lambda m, name: "mlp" in name)
    assert all(isinstance(converted.get_submodule(f"model.layers.{i}.mlp.up_proj"), lowbit.LowPrecisionLinear)
               for i in range(3))
    assert type(converted.model.layers[0].self_attn.q_proj) is nn.Linear
    hf.load_state_dict(lowbit.plain_state_dict(converted), strict=True)
    x = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert torch.equal(hf(x).logits, lowbit.unconvert(converted)(x).logits)
