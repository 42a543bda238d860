"""Compilation scopes (lowbit.train.compile): regional compilation compiles one block's graph for all blocks and
computes what the eager model does; the trainer's telemetry steps run eagerly under either scope. CPU checks use
the aot_eager backend (dynamo and AOTAutograd as on a GPU, no inductor code generation: seconds, not minutes)."""

import copy
import functools

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import SMALL, cli, losses, read_metrics
from lowbit.models.llama import Llama, ModelArgs
from lowbit.numerics.recipes import convert, get_recipe
from lowbit.train.compile import compile_model, eager


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model(recipe: str, checkpointing: str) -> Llama:
    torch.manual_seed(0)
    args = ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256, max_seq_len=32,
                     checkpointing=checkpointing)
    model = Llama(args)
    convert(model, get_recipe(recipe))
    return model


@pytest.mark.parametrize("recipe,checkpointing", [("bf16", "none"), ("fp8-delayed", "full"), ("fp4", "selective"),
                                                  ("fp8-delayed", "selective"), ("fp8-tensorwise", "none"),
                                                  ("fp8-rowwise", "none"), ("fp4-no-occ", "full")])
@pytest.mark.slow
def test_blocks_share_one_graph_and_match_eager(recipe, checkpointing):
    ref, model = _model(recipe, checkpointing), _model(recipe, checkpointing)
    run = compile_model(model, "blocks", backend="aot_eager")
    x = torch.randint(0, 256, (2, 32))
    for _ in range(3):  # later steps read the scaling state the earlier ones left (delayed scaling)
        got, want = run(x, x), ref(x, x)
        got.backward(), want.backward()
        assert got.item() == want.item()
    # one graph for the four blocks, one for the head; no block recompiled, none broken (checkpoints included)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["recompiles"] and not counters["graph_break"]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # the scaling states saw each forward once: a checkpointed block's recomputation records nothing
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name
    frames = counters["stats"]["calls_captured"]
    with eager():  # compiled regions step aside: nothing is traced, the loss is the same
        assert run(x, x).item() == ref(x, x).item()
    assert counters["stats"]["calls_captured"] == frames


def _block_forward_graph(recipe: str):
    """The forward graph of a compiled block of 96 tokens (no weight has 96 rows or columns), split from backward
    by inductor's partitioner."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    forwards = []

    def keep(gm, _):
        forwards.append(gm)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=keep, bw_compiler=lambda gm, _: make_boxed_func(gm.forward),
                           partition_fn=min_cut_rematerialization_partition)
    run = compile_model(_model(recipe, "none"), "blocks", backend=backend)
    x = torch.randint(0, 256, (3, 32))
    run(x, x).backward()
    return forwards[0].graph


@pytest.mark.slow
def test_linears_reading_one_input_cast_it_once():
    """q, k, v read one normed input and w1, w3 another. A current scale depends on its tensor alone, so the
    compiled block casts each input to FP8 once (qkv, wo, w1/w3, w2: 4 casts), not once per linear (7)."""
    to_fp8 = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
    casts = [n for n in _block_forward_graph("fp8-tensorwise").nodes if n.target in to_fp8
             and n.meta["val"].dtype == torch.float8_e4m3fn and n.meta["val"].shape[0] == 96]
    assert len(casts) == 4


def _saved(graph) -> list[torch.Tensor]:
    """What a forward graph keeps for backward, parameters and buffers (its `primals` inputs) left out."""
    return [a.meta["val"] for a in next(n for n in graph.nodes if n.op == "output").args[0]
            if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)
            and not a.name.startswith("primals")]


@pytest.mark.slow
def test_compiled_block_keeps_no_fp8_copy_of_an_input_it_can_remake(monkeypatch):
    """Compiled, a linear keeps its input, not an FP8 copy: the partitioner remakes the norms' outputs and SwiGLU's
    product in backward from what their own backward keeps. Of the four inputs' FP8 copies (kept transposed) at
    most one stays, as with torchao's float8 linears, and the block keeps fewer bytes than with the copies."""
    import lowbit.numerics.linear

    saved = _saved(_block_forward_graph("fp8-tensorwise"))
    fp8 = [v for v in saved if v.dtype == torch.float8_e4m3fn and 96 in v.shape]
    assert len(fp8) <= 1, [tuple(v.shape) for v in fp8]  # the FP8 copies kept before: 4
    torch._dynamo.reset()
    monkeypatch.setattr(lowbit.numerics.linear, "_keeps_input", lambda recipe, clamped: False)  # the FP8 copy, as eagerly
    copies = _saved(_block_forward_graph("fp8-tensorwise"))
    assert len([v for v in copies if v.dtype == torch.float8_e4m3fn and 96 in v.shape]) >= 4
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    assert nbytes(saved) < 0.95 * nbytes(copies)  # on this CPU graph (fp32): 303,780 vs 334,488 bytes


def test_a_copy_of_a_compiled_model_runs_its_own_head():
    model = _model("bf16", "none")
    compile_model(model, "blocks", backend="aot_eager")
    twin = copy.deepcopy(model)
    assert "head" not in twin.__dict__
    with torch.no_grad():
        twin.norm.weight.mul_(2)
    x = torch.randint(0, 256, (2, 32))
    assert twin(x, x).item() != model(x, x).item()


def test_model_scope_is_one_graph():
    args = ModelArgs(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256, max_seq_len=32)
    model = Llama(args)
    x = torch.randint(0, 256, (2, 32))
    want = model(x, x).item()
    assert compile_model(model, "model", backend="aot_eager")(x, x).item() == pytest.approx(want, rel=1e-6)
    assert counters["stats"]["unique_graphs"] == 1


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="compile scope"):
        compile_model(Llama(ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=64,
                                      max_seq_len=32)),
                      "layers")


@pytest.mark.parametrize("scope", ["blocks", "model"])
@pytest.mark.slow
def test_compiled_training_matches_eager_and_records_telemetry(tmp_path, capsys, monkeypatch, scope):
    import lowbit.train.trainer as trainer

    common = [*SMALL, "--recipe", "fp8-tensorwise", "--train.steps", "4", "--numerics.telemetry_every", "2"]
    code, _, err = cli(capsys, "train", *common, "--run.dir", tmp_path / "eager")
    assert code == 0, err
    monkeypatch.setattr(trainer, "compile_model", functools.partial(compile_model, backend="aot_eager"))
    code, _, err = cli(capsys, "train", *common, "--train.compile", "true", "--train.compile_scope", scope,
                       "--run.dir", tmp_path / "compiled")
    assert code == 0, err
    assert losses(tmp_path / "compiled") == losses(tmp_path / "eager")
    # telemetry at steps 1, 2 and 4: run eagerly, so every operand's statistics were seen
    telemetry = [r for r in read_metrics(tmp_path / "compiled") if "numerics" in r]
    assert [r["step"] for r in telemetry] == [1, 2, 4]
    assert telemetry == [r for r in read_metrics(tmp_path / "eager") if "numerics" in r]


def test_bad_scope_is_a_config_error(tmp_path, capsys):
    code, _, err = cli(capsys, "train", *SMALL, "--train.compile_scope", "layers", "--run.dir", tmp_path / "r")
    assert code != 0 and "compile_scope" in err and len(err.strip().splitlines()) == 1


def _min_cut(keep_mutations: bool = True):
    """AOTAutograd with inductor's partitioner (which recomputes cheap ops in backward) and its in-graph buffer
    updates, running the graphs as traced: what inductor partitions, without its code generation."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    run = lambda gm, _: make_boxed_func(gm.forward)  # noqa: E731
    return aot_autograd(fw_compiler=run, bw_compiler=run, partition_fn=min_cut_rematerialization_partition,
                        keep_inference_input_mutations=keep_mutations)


@pytest.mark.parametrize("recipe,checkpointing", [("fp8-delayed", "full"), ("fp8-delayed", "selective"),
                                                  ("fp8-tensorwise", "full")])
@pytest.mark.slow
def test_checkpointed_compiled_blocks_recompute_the_forward_casts(recipe, checkpointing):
    """A checkpointed compiled block recomputes its casts in backward from the scaling state: the state must still
    be what the forward read (delayed amaxes are recorded at the end of backward), or the gradients drift from the
    second step on (they did by 8-9% when the forward recorded them)."""
    ref, model = _model(recipe, "none"), _model(recipe, checkpointing)
    runs = [compile_model(m, "blocks", backend=_min_cut()) for m in (ref, model)]
    for step in range(3):
        x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))  # new amaxes each step
        for run in runs:
            run(x, x).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert torch.equal(p.grad, q.grad), name
            p.grad = q.grad = None
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert torch.equal(b, c), name
