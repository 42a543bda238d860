"""The LLaMA model: equality with HF transformers, memory behaviour of attention, checkpointing, presets."""

import math

import pytest
import torch

from lowbit.errors import LowbitError
from lowbit.models.llama import PRESETS, Llama, ModelArgs, resolve_model_args, swiglu_hidden
from lowbit.tools.export_hf import hf_config, hf_state_dict
from lowbit.train.config import ModelConfig


def small_args(**kw) -> ModelArgs:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=320, max_seq_len=64,
                rope_theta=500.0, norm_eps=1e-5)
    return ModelArgs(**{**base, **kw})


@pytest.mark.parametrize("n_kv_heads,tie", [(2, False), (4, False), (1, True), (2, True)])
def test_logits_match_hf_llama(n_kv_heads, tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = Llama(small_args(n_kv_heads=n_kv_heads, tie_embeddings=tie)).eval()
    cfg = {k: v for k, v in hf_config(model.args, 0).items() if k not in ("architectures", "model_type", "torch_dtype")}
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    if tie:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 320, (2, 48))
    with torch.no_grad():
        diff = (model(x) - hf(x).logits).abs().max().item()
    assert diff <= 1e-4


def _saved_shapes(model, x):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x).backward()
    return shapes


@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_no_seq_by_seq_tensor_saved_for_backward(policy):
    seq = 2048
    model = Llama(small_args(dim=32, n_heads=2, n_kv_heads=1, ffn_dim=96, vocab_size=64, max_seq_len=seq,
                             checkpointing=policy))
    x = torch.randint(0, 64, (1, seq))
    shapes = _saved_shapes(model, x)
    assert shapes, "hook saw nothing"
    assert not [s for s in shapes if sum(d >= seq for d in s) >= 2], "a seq x seq tensor was saved"


def _backward_op_counts(model, x):
    """How often mm and silu run during backward (recomputation shows up here)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    loss = model(x, x)
    with Count() as c:
        loss.backward()
    return c.n


def test_checkpointing_policies_same_gradients_and_recompute_what_they_say():
    torch.manual_seed(0)
    ref = Llama(small_args())
    x = torch.randint(0, 320, (2, 32))
    grads, counts = {}, {}
    for policy in ("none", "full", "selective"):
        m = Llama(dataclass_replace(ref.args, checkpointing=policy))
        m.load_state_dict(ref.state_dict())
        counts[policy] = _backward_op_counts(m, x)
        grads[policy] = [p.grad.clone() for p in m.parameters()]
    for policy in ("full", "selective"):
        for a, b in zip(grads["none"], grads[policy]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    mm = lambda c: c["mm"] + c["addmm"] + c["bmm"]  # noqa: E731
    assert counts["none"]["silu"] == ref.args.n_layers  # SwiGLU's backward recomputes silu(a) (not saved)
    # full recomputes the block's matmuls (all whose outputs backward needs: early stop skips the last one)
    assert mm(counts["full"]) >= mm(counts["none"]) + 6 * ref.args.n_layers
    assert mm(counts["selective"]) == mm(counts["none"])  # selective keeps the matmul outputs...
    assert counts["selective"]["silu"] == 2 * ref.args.n_layers  # ...and recomputes the elementwise work


def dataclass_replace(args, **kw):
    import dataclasses

    return dataclasses.replace(args, **kw)


def test_tinyllama_preset_shape_and_size():
    args = resolve_model_args(ModelConfig(preset="1b"), vocab_size=32000, seq_len=2048)
    assert (args.n_layers, args.dim, args.n_heads, args.n_kv_heads, args.ffn_dim, args.vocab_size) == \
        (22, 2048, 32, 4, 5632, 32000)
    with torch.device("meta"):
        model = Llama(args)
    assert model.num_params() == 1_100_048_384  # TinyLlama-1.1B's published count


def test_7b_preset_size():
    args = resolve_model_args(ModelConfig(preset="7b"), vocab_size=32000, seq_len=2048)
    assert args.ffn_dim == 11008 == swiglu_hidden(4096, 256)
    with torch.device("meta"):
        model = Llama(args)
    assert model.num_params() == 6_738_415_616  # LLaMA-7B


def test_13b_preset_size():
    args = resolve_model_args(ModelConfig(preset="13b"), vocab_size=32000, seq_len=2048)
    assert (args.dim, args.n_layers, args.n_heads, args.ffn_dim) == (5120, 40, 40, 13824)
    with torch.device("meta"):
        model = Llama(args)
    assert model.num_params() == 13_015_864_320  # LLaMA-13B


@pytest.mark.parametrize("attention", ["sdpa", "performer"])
def test_a_model_built_on_meta_and_materialized_starts_as_a_plain_build(attention):
    """The trainer builds on the meta device and initializes on the training device (lowbit.models.init): the
    same weights, buffers and performer features as a model built plainly on the CPU from the same seed, and
    another seed gives others."""
    from lowbit.models.init import materialize

    args = resolve_model_args(ModelConfig(preset="tiny", n_layers=2, attention=attention), vocab_size=512,
                              seq_len=64)
    torch.manual_seed(7)
    plain = Llama(args)
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = Llama(args)
    materialize(meta, "cpu")
    a, b = plain.state_dict(), meta.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(plain.rope_cos, meta.rope_cos) and torch.equal(plain.rope_sin, meta.rope_sin)
    torch.manual_seed(8)
    other = Llama(args)
    assert not torch.equal(other.layers[0].attention.wq.weight, plain.layers[0].attention.wq.weight)
    w = [p for n, p in plain.named_parameters() if "norm" not in n]  # every tensor its own stream
    assert all(not torch.equal(x.flatten()[:16], y.flatten()[:16]) for x, y in zip(w, w[1:]))


def test_every_preset_builds_on_meta():
    for name in PRESETS:
        args = resolve_model_args(ModelConfig(preset=name), vocab_size=4096, seq_len=128)
        with torch.device("meta"):
            Llama(args)


def test_init_scales_residual_projections():
    torch.manual_seed(0)
    model = Llama(small_args(dim=256, n_layers=8, n_heads=4, n_kv_heads=4, ffn_dim=704, vocab_size=2048))
    std = lambda t: t.float().std().item()  # noqa: E731
    assert abs(std(model.layers[0].attention.wq.weight) - 0.02) < 2e-3
    assert abs(std(model.layers[0].attention.wo.weight) - 0.02 / 4) < 5e-4
    assert abs(std(model.layers[0].feed_forward.w2.weight) - 0.02 / 4) < 5e-4
    assert torch.all(model.layers[0].attention_norm.weight == 1)


def test_tied_embeddings_share_one_tensor():
    model = Llama(small_args(tie_embeddings=True))
    assert model.output is None
    untied = Llama(small_args(tie_embeddings=False))
    assert untied.num_params() - model.num_params() == 320 * 64


@pytest.mark.parametrize("kw,match", [
    (dict(dim=100, n_heads=3), "divisible by model.n_heads"),
    (dict(n_heads=4, n_kv_heads=3), "divisible by model.n_kv_heads"),
    (dict(vocab_size=100), "smaller than the tokenizer"),
    (dict(max_seq_len=64), "shorter than data.seq_len"),
])
def test_bad_shapes_are_one_line_errors(kw, match):
    with pytest.raises(LowbitError, match=match) as e:
        resolve_model_args(ModelConfig(**kw), vocab_size=300, seq_len=128)
    assert "\n" not in str(e.value)


def test_vocab_rounds_up_from_tokenizer():
    assert resolve_model_args(ModelConfig(), vocab_size=4097, seq_len=16).vocab_size == 4160


def test_ffn_width_follows_multiple_of_and_explicit_size():
    assert resolve_model_args(ModelConfig(ffn_multiple_of=32), vocab_size=300, seq_len=16).ffn_dim == 704
    assert resolve_model_args(ModelConfig(ffn_multiple_of=256), vocab_size=300, seq_len=16).ffn_dim == 768
    assert resolve_model_args(ModelConfig(ffn_dim=500), vocab_size=300, seq_len=16).ffn_dim == 500



def _norm_formula(x, weight, eps):
    """RMSNorm as plain autograd sees it (the model's formula before its hand-written backward)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _grads(fn, dy, *inputs):
    """fn's output and the gradients of its inputs (fresh leaves) for the output gradient dy."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    y.backward(dy)
    return y.detach(), [t.grad for t in leaves]


def _saved(fn, *inputs):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(*inputs)
    return saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_hand_written_backward_matches_autograd(dtype):
    from lowbit.models.llama import _RMSNorm

    torch.manual_seed(0)
    x = (torch.randn(3, 7, 96) * 3).to(dtype).requires_grad_()
    x.data[0, 0] = 0  # an all-zero row: rstd = 1/sqrt(eps), gradient still finite
    weight = torch.randn(96) * 0.5 + 1
    dy = torch.randn(3, 7, 96)
    y, (dx, dw) = _grads(lambda x, w: _RMSNorm.apply(x, w, 1e-5), dy, x, weight)
    y_ref, (dx_ref, dw_ref) = _grads(lambda x, w: _norm_formula(x, w, 1e-5), dy, x, weight)
    assert torch.equal(y, y_ref)  # the forward is the formula's, bit for bit
    assert dx.dtype == dtype and dw.dtype == torch.float32
    if dtype == torch.float32:
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-6)
    else:  # the same fp32 values up to summation order, then rounded: at most one bf16 step apart
        torch.testing.assert_close(dx.float(), dx_ref.float(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-6, atol=1e-6)
    # what backward keeps: x as it came and one fp32 rstd per row (and the weight, a parameter anyway)
    saved = _saved(lambda x: _RMSNorm.apply(x, weight, 1e-5), x)
    assert sorted((tuple(t.shape), t.dtype) for t in saved if t is not weight) == \
        sorted([((3, 7, 96), dtype), ((3, 7, 1), torch.float32)])
    assert any(t is x for t in saved)


@pytest.mark.parametrize("dtype_a,dtype_b", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                             (torch.bfloat16, torch.float32)])
def test_silu_mul_keeps_two_tensors_and_autograds_gradients(dtype_a, dtype_b):
    from lowbit.models.llama import SwiGLU

    torch.manual_seed(0)
    a, b = (torch.randn(4, 5, 64) * 4).to(dtype_a), torch.randn(4, 5, 64).to(dtype_b)
    dy = torch.randn(4, 5, 64).to(torch.promote_types(dtype_a, dtype_b))
    y, grads = _grads(SwiGLU(), dy, a, b)
    y_ref, grads_ref = _grads(lambda a, b: torch.nn.functional.silu(a) * b, dy, a, b)
    assert torch.equal(y, y_ref)
    for g, g_ref in zip(grads, grads_ref):  # autograd's own kernels on the same values
        assert torch.equal(g, g_ref)
    assert len(_saved(SwiGLU(), a.requires_grad_(), b.requires_grad_())) == 2


def test_model_gradients_match_plain_autograd_formulas(monkeypatch):
    """The whole model with its hand-written backwards against the same model built from plain formulas."""
    import lowbit.models.llama as llama

    torch.manual_seed(0)
    model = Llama(small_args())
    x = torch.randint(0, 320, (2, 32))
    model(x, x).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    monkeypatch.setattr(llama.RMSNorm, "forward", lambda self, h: _norm_formula(h, self.weight, self.eps))
    monkeypatch.setattr(llama.SwiGLU, "forward", lambda self, a, b: torch.nn.functional.silu(a) * b)
    model.zero_grad(set_to_none=True)
    model(x, x).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)


def test_norm_and_swiglu_trace_under_torch_compile():
    from lowbit.models.llama import RMSNorm, SwiGLU

    torch.manual_seed(0)
    norm, act = RMSNorm(32, 1e-5), SwiGLU()
    fn = lambda x, w1, w3: act(norm(x) @ w1, norm(x) @ w3).sum()  # noqa: E731
    x, w1, w3 = torch.randn(2, 8, 32), torch.randn(32, 48), torch.randn(32, 48)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    _, grads = _grads(compiled, torch.tensor(1.0), x, w1, w3)
    _, grads_ref = _grads(fn, torch.tensor(1.0), x, w1, w3)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref)


def test_sdpa_backends_agree_and_trace_whole():
    from lowbit.models.llama import CausalSDPA, sdpa_order

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 32, 16, requires_grad=True) for _ in range(3))
    assert sdpa_order("auto", q) is None  # torch's own choice
    ref = CausalSDPA("auto")(q, k, v)
    for backend in ("math", "flash"):
        out = CausalSDPA(backend)(q, k, v)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    # the kernel choice is a context dynamo traces, not a graph break
    compiled = torch.compile(CausalSDPA("math"), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(LowbitError, match="CUDA only"):
        CausalSDPA("cudnn")(q, k, v)
    with pytest.raises(LowbitError, match="not one of"):
        CausalSDPA("fast")


def _loss_and_grads(model, x):
    loss = model(x, x)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return loss.detach(), grads


def test_dropout_zero_is_the_plain_block_and_train_equals_eval():
    """model.dropout 0 adds no op: a block is exactly x + attention, + feed-forward, and training mode computes
    what eval mode does."""
    torch.manual_seed(0)
    model = Llama(small_args())
    x = torch.randint(0, 320, (2, 16))
    block, h = model.layers[0], model.tok_embeddings(x)
    cos, sin = model.rope_cos[:16], model.rope_sin[:16]
    mid = h + block.attention(block.attention_norm(h), cos, sin)
    assert torch.equal(block(h, cos, sin), mid + block.feed_forward(block.ffn_norm(mid)))
    train = _loss_and_grads(model.train(), x)
    evaluated = _loss_and_grads(model.eval(), x)
    assert torch.equal(train[0], evaluated[0]) and all(torch.equal(a, b) for a, b in zip(train[1], evaluated[1]))


def test_dropout_changes_training_only_and_recomputes_its_masks():
    torch.manual_seed(0)
    plain = Llama(small_args())
    dropped = Llama(small_args(dropout=0.2))
    dropped.load_state_dict(plain.state_dict())
    x = torch.randint(0, 320, (2, 32))
    torch.manual_seed(1)
    loss, grads = _loss_and_grads(dropped.train(), x)
    assert not torch.equal(loss, plain.train()(x, x).detach())
    assert not torch.equal(loss, dropped(x, x).detach())  # fresh masks each step
    with torch.no_grad():
        assert torch.equal(dropped.eval()(x), plain.eval()(x))  # validation and generation: no dropout
    for policy in ("full", "selective"):  # the recomputed forward draws the masks the first one drew
        again = Llama(small_args(dropout=0.2, checkpointing=policy))
        again.load_state_dict(plain.state_dict())
        torch.manual_seed(1)
        loss2, grads2 = _loss_and_grads(again.train(), x)
        assert torch.equal(loss, loss2), policy
        for a, b in zip(grads, grads2):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
