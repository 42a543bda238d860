"""Performer (FAVOR+) attention: the estimate converges to softmax, the chunked causal path equals the naive one
forward and backward, memory grows linearly, and it trains, resumes and converts like the sdpa model."""

import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import SMALL, cli, losses
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lowbit.errors import LowbitError
from lowbit.models import performer
from lowbit.models.llama import Llama, ModelArgs
from lowbit.models.performer import (CausalLinearAttention, Performer, default_features, favor_attention,
                                     feature_map, orthogonal_features)
from lowbit.numerics.recipes import RECIPES, convert, get_recipe
from lowbit.train.checkpoint import find_resumable, read_whole


def qkv(b=1, h=4, n=64, d=16, scale=0.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g, dtype=dtype) * scale for _ in range(3)]


def naive_causal(q, k, v, w):
    """Masked linear attention with the L×L matrix materialized: the reference."""
    a = (feature_map(q, w, True) @ feature_map(k, w, False).transpose(-1, -2)).tril()
    return (a @ v) / a.sum(-1, keepdim=True)


def test_orthogonal_features_are_orthogonal_in_blocks_with_gaussian_norms():
    w = orthogonal_features(40, 16, torch.Generator().manual_seed(0)).double()
    block = w[:16] / w[:16].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.t(), torch.eye(16, dtype=torch.float64), atol=1e-6, rtol=0)
    assert w.shape == (40, 16) and 2.5 < w.norm(dim=1).mean() < 5.5  # chi(16) has mean ~3.9
    assert default_features(64) == 266


@pytest.mark.parametrize("is_query", [True, False])
def test_feature_map_backward_equals_autograd_of_its_formula(is_query):
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64, requires_grad=True)
    w = orthogonal_features(20, 8, torch.Generator().manual_seed(0)).double()
    xs = x * 8 ** -0.25
    logits = xs @ w.t() - xs.pow(2).sum(-1, keepdim=True) / 2
    shift = logits.amax(-1, keepdim=True) if is_query else logits.amax((-2, -1), keepdim=True)
    ref = torch.exp(logits - shift.detach())
    got = feature_map(x, w, is_query)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=0)
    g = torch.randn_like(ref)
    (dx_ref,) = torch.autograd.grad(ref, x, g)
    (dx,) = torch.autograd.grad(got, x, g)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-10, atol=1e-12)


def test_noncausal_favor_approaches_softmax_as_features_grow():
    q, k, v = qkv()
    exact = F.scaled_dot_product_attention(q, k, v)
    errors = []
    for m in (16, 64, 256, 1024):
        runs = [favor_attention(q, k, v, orthogonal_features(m, 16, torch.Generator().manual_seed(s)).double(),
                                causal=False) for s in range(6)]
        errors.append(sum((r - exact).norm() / exact.norm() for r in runs).item() / len(runs))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.5 * errors[0] and errors[-1] < 0.15, errors  # ~1/sqrt(M): 16x the features, 1/4 error


def test_causal_favor_approaches_causal_softmax():
    q, k, v = qkv(n=48)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    w = orthogonal_features(2048, 16, torch.Generator().manual_seed(0)).double()
    assert ((favor_attention(q, k, v, w, chunk=16) - exact).norm() / exact.norm()).item() < 0.1


@pytest.mark.parametrize("group", [8192, 16])  # one group, and several groups of 2 (or 16) chunks
@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_causal_chunked_equals_naive_forward_and_backward_fp64(chunk, group, monkeypatch):
    monkeypatch.setattr(performer, "GROUP", group)
    w = orthogonal_features(24, 16, torch.Generator().manual_seed(1)).double()
    ours, ref = qkv(b=2, h=2, n=64), qkv(b=2, h=2, n=64)
    for t in ours + ref:
        t.requires_grad_()
    out, expected = favor_attention(*ours, w, chunk=chunk), naive_causal(*ref, w)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (expected * g).sum().backward()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)


def test_causal_kernel_backward_passes_gradcheck(monkeypatch):
    monkeypatch.setattr(performer, "GROUP", 8)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.rand(1, 2, 13, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 13, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: CausalLinearAttention.apply(a, b, c, 4), (q, k, v))


def test_later_positions_do_not_change_earlier_outputs():
    q, k, v = qkv(n=32, dtype=torch.float32)
    w = orthogonal_features(32, 16)
    out = favor_attention(q, k, v, w, chunk=8)
    k2, v2 = k.clone(), v.clone()
    k2[..., 20:, :] *= 3  # also moves the keys' stabilizer, which must cancel
    v2[..., 20:, :] = 0
    torch.testing.assert_close(favor_attention(q, k2, v2, w, chunk=8)[..., :20, :], out[..., :20, :],
                               rtol=1e-5, atol=1e-6)


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created inside the block and still alive (autograd's saved tensors included):
    a CPU stand-in for torch.cuda.max_memory_allocated."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = set(), 0, 0

    def _free(self, key, n):
        self.live.discard(key)
        self.now -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(st := t.untyped_storage()) not in self.live:
                self.live.add(id(st))
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(st, self._free, id(st), st.nbytes())
        return out


def peak_forward_backward(n: int, attention) -> int:
    q, k, v = (t.requires_grad_() for t in qkv(b=1, h=2, n=n, d=16, dtype=torch.float32))
    with PeakMemory() as mem:
        attention(q, k, v).sum().backward()
    return mem.peak


@pytest.mark.parametrize("group", [8192, 256])
def test_causal_performer_memory_grows_linearly_in_length(group, monkeypatch):
    monkeypatch.setattr(performer, "GROUP", group)
    w = orthogonal_features(32, 16)
    # peak = a + b·L: going from 2L to 4L adds twice what going from L to 2L added (4x if quadratic)
    growth = lambda p: (p[2] - p[1]) / (p[1] - p[0])  # noqa: E731
    favor = [peak_forward_backward(n, lambda q, k, v: favor_attention(q, k, v, w, chunk=64))
             for n in (512, 1024, 2048)]
    assert 1.8 < growth(favor) < 2.2, favor
    # the same measurement sees the quadratic growth of attention that materializes its L×L weights
    masked = lambda q, k, v: F.softmax((q @ k.transpose(-1, -2)).masked_fill(  # noqa: E731
        torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).triu(1), float("-inf")), -1) @ v
    dense = [peak_forward_backward(n, masked) for n in (512, 1024, 2048)]
    assert growth(dense) > 3.5, dense


def tiny_args(**kw):
    return ModelArgs(**{**dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256,
                               max_seq_len=64, attention="performer"), **kw})


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_performer_model_runs_under_every_recipe(recipe):
    torch.manual_seed(0)
    model = Llama(tiny_args())
    convert(model, get_recipe(recipe))
    tokens = torch.randint(0, 256, (2, 64))
    loss = model(tokens, tokens)
    loss.backward()
    assert torch.isfinite(loss) and model.layers[0].attention.wq.weight.grad is not None


def test_performer_model_keeps_sdpa_weights_and_saves_its_features():
    torch.manual_seed(0)
    sdpa = Llama(tiny_args(attention="sdpa"))
    torch.manual_seed(0)
    perf = Llama(tiny_args())
    assert all(torch.equal(sdpa.state_dict()[k], v) for k, v in perf.state_dict().items() if "core" not in k)
    # bf16 products (fp32 features and sums) stay close to the fp32 computation
    tokens = torch.randint(0, 256, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = perf(tokens, tokens)
    assert abs(low.item() - perf(tokens, tokens).item()) < 0.02
    assert perf.state_dict()["layers.0.attention.core.features"].shape == (default_features(16), 16)


def test_bad_performer_settings_are_clear_errors(capsys):
    with pytest.raises(LowbitError, match="performer_features: must be > 0"):
        Performer(16, 0, 64)
    with pytest.raises(LowbitError, match="performer_chunk: must be > 0"):
        Performer(16, 8, 0)
    with pytest.raises(LowbitError, match="chunk size must be > 0"):
        favor_attention(*qkv(), orthogonal_features(8, 16).double(), chunk=-1)
    for key, value in (("model.performer_features", "0"), ("model.performer_chunk", "-4"),
                       ("model.performer_redraw", "-1"), ("model.attention", "linear")):
        code, _, err = cli(capsys, "train", f"--{key}", value)
        assert code == 2 and key in err and len(err.strip().splitlines()) == 1, err


def test_performer_trains_redraws_and_resumes_bit_exactly(tmp_path, capsys):
    perf = [*SMALL, "--model.attention", "performer", "--model.performer_redraw", "3", "--train.steps", "8",
            "--checkpoint.every", "4"]
    assert cli(capsys, "train", *perf, "--run.dir", tmp_path / "straight")[0] == 0
    assert cli(capsys, "train", *perf, "--train.stop_at", "4", "--run.dir", tmp_path / "split")[0] == 0
    assert cli(capsys, "train", *perf, "--run.resume", "--run.dir", tmp_path / "split")[0] == 0
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")
    assert losses(tmp_path / "straight")[8] < losses(tmp_path / "straight")[1]
    first = read_whole(tmp_path / "split" / "checkpoints" / "step_00000004")
    last = read_whole(find_resumable(tmp_path / "straight"))
    key = "layers.0.attention.core.features"
    assert not torch.equal(first[key], last[key])  # redrawn at step 6


def test_performer_run_generates_but_is_not_exported_to_hf(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli(capsys, "train", *SMALL, "--model.attention", "performer", "--train.steps", "2",
               "--run.dir", run)[0] == 0
    code, out, _ = cli(capsys, "generate", run, "--max-new-tokens", "4")
    assert code == 0 and out.strip()
    code, _, err = cli(capsys, "export-hf", run, tmp_path / "hf")
    assert code == 2 and "performer attention" in err and not (tmp_path / "hf").exists()
