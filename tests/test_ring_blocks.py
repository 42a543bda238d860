"""The ring's block schedule on one device (no process group) equals SDPA over the whole sequence, forward and
gradients, through the fused kernels and through the math fallback; the schedule covers every allowed (query,
key) pair exactly once with no masked call; nothing of size L x L is kept for backward."""

import pytest
import torch
import torch.nn.functional as F

from lowbit.distributed import attention_block
from lowbit.distributed.attention_block import block_backward, block_forward, math_backward, math_forward
from lowbit.distributed.context_parallel import OneDeviceRingCore, shard_positions
from lowbit.distributed.ring_blocks import OneDeviceRing, block_plan
from lowbit.models.llama import Llama, ModelArgs


@pytest.fixture(params=[False, True], ids=["kernel", "math"])
def math_path(request, monkeypatch):
    monkeypatch.setitem(attention_block.FORCE_MATH, "on", request.param)
    return request.param


def _problem(L, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, L, 8, generator=g) for _ in range(4)]


@pytest.mark.parametrize("cp,layout", [(2, "zigzag"), (4, "zigzag"), (3, "plain"), (2, "plain")])
@pytest.mark.parametrize("causal", [True, False])
def test_one_device_ring_equals_sdpa(cp, layout, causal, math_path):
    L = 48
    q, k, v, dout = _problem(L)
    grads = []
    for attend in (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal),
                   lambda a, b, c: OneDeviceRing.apply(a, b, c, torch.stack(
                       [shard_positions(L, cp, r, layout) for r in range(cp)]), causal)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(dout)
        grads.append([out.detach()] + [t.grad for t in leaves])
    for got, ref in zip(grads[1], grads[0]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal,lq,lk", [(True, 16, 16), (False, 12, 20)])
def test_kernel_block_matches_math_with_global_output_and_lse(causal, lq, lk):
    """The kernel's backward takes the output and log-sum-exp it is given (the whole row's, in a ring): fed ones
    other than its own, it must still agree with the math."""
    g = torch.Generator().manual_seed(1)
    q, dout = torch.randn(2, 3, lq, 8, generator=g), torch.randn(2, 3, lq, 8, generator=g)
    k, v = torch.randn(2, 3, lk, 8, generator=g), torch.randn(2, 3, lk, 8, generator=g)
    out, lse = block_forward(q, k, v, causal, 0.3)
    ref_out, ref_lse = math_forward(q, k, v, causal, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    glob_out, glob_lse = torch.randn(out.shape, generator=g), lse + torch.rand(lse.shape, generator=g)
    for got, ref in zip(block_backward(dout, q, k, v, glob_out, glob_lse, causal, 0.3),
                        math_backward(dout, q, k, v, glob_out, glob_lse, causal, 0.3)):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


ZIGZAG = [tuple(shard_positions(24, 3, r).tolist()) for r in range(3)]


def _covered(plan, pos_q, pos_k):
    hits = torch.zeros(len(pos_q), len(pos_k), dtype=torch.int64)
    for q0, q1, k0, k1, causal in plan:
        block = torch.ones(q1 - q0, k1 - k0, dtype=torch.int64)
        hits[q0:q1, k0:k1] += block.tril() if causal else block
        if causal:
            assert q1 - q0 == k1 - k0 and pos_q[q0:q1] == pos_k[k0:k1]
    return hits


@pytest.mark.parametrize("pos_q,pos_k", [
    (tuple(range(3, 10)), tuple(range(0, 7))),  # stretches overlapping in part
    ((0, 1, 2, 10, 11), (1, 2, 3, 9, 10, 11, 12)),
    (ZIGZAG[1], ZIGZAG[2]),
    (ZIGZAG[1], ZIGZAG[1]),
])
def test_plan_covers_each_allowed_pair_once(pos_q, pos_k):
    allowed = (torch.tensor(pos_q)[:, None] >= torch.tensor(pos_k)[None, :]).long()
    assert torch.equal(_covered(block_plan(pos_q, pos_k, True), pos_q, pos_k), allowed)


def test_zigzag_rank_runs_one_call_per_block():
    pos = [tuple(shard_positions(32, 2, r).tolist()) for r in range(2)]
    assert block_plan(pos[0], pos[0], True) == ((0, 16, 0, 16, True),)  # the diagonal: one causal call
    assert block_plan(pos[0], pos[1], True) == ((8, 16, 0, 16, False),)  # the late chunk sees all of rank 1
    assert block_plan(pos[1], pos[0], True) == ((0, 16, 0, 8, False),)  # all of rank 1 sees rank 0's early chunk


def test_one_device_ring_keeps_no_seq_by_seq_tensor_for_backward():
    seq = 2048
    args = ModelArgs(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=96, vocab_size=64, max_seq_len=seq)
    model = Llama(args)
    for m in model.modules():
        if hasattr(m, "core"):
            m.core = OneDeviceRingCore(4, seq)
    x = torch.randint(0, 64, (1, seq))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        model(x, x).backward()
    assert shapes and not [s for s in shapes if sum(d >= seq // 4 for d in s) >= 2]


def test_model_with_one_device_ring_matches_sdpa_model():
    torch.manual_seed(0)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=64, max_seq_len=32)
    ref = Llama(args)
    ring = Llama(args)
    ring.load_state_dict(ref.state_dict())
    for m in ring.modules():
        if hasattr(m, "core"):
            m.core = OneDeviceRingCore(2, 32)
    x = torch.randint(0, 64, (2, 32))
    losses = [m(x, x) for m in (ref, ring)]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(ref.named_parameters(), ring.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_cp_memory_prediction_from_two_measured_lengths():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import cp_memory

    rows = [dict(policy="none", length=8192, fixed_gib=16.0, peak_above_fixed_gib=9.0),
            dict(policy="none", length=16384, fixed_gib=16.0, peak_above_fixed_gib=17.0)]
    fixed, intercept, slope = cp_memory.fit(rows)["none"]
    assert (fixed, intercept, slope * 8192) == (16.0, 1.0, 8.0)
    report = dict(device="d", torch="t", command="c", model=rows)
    # 100 GiB card, 3 reserved: (100 - 3 - 16 - 1) GiB at 1 GiB per 1024 tokens, times cp
    assert cp_memory.table(report, {"G": 100.0}, 3.0, [1, 2]).splitlines()[-1].endswith("| 81,920 | 163,840 |")
