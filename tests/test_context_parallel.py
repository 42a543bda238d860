"""Ring attention and ring self-attention (2 and 4 gloo processes) equal full attention, forward and backward,
under the zigzag and the plain split, keeping nothing of size queries x keys for backward."""

import pytest
import torch
import torch.nn.functional as F
from distributed_util import init_gloo, spawn

from lowbit.distributed.context_parallel import RingAttention, RingSelfAttention, shard_positions, zigzag_positions
from lowbit.distributed.kv_wire import KVWire
from lowbit.errors import LowbitError
from lowbit.train.plan import load_config

B, H, L, D = 2, 3, 24, 8
GQA = (4, 2)  # the grouped-query problem: 4 query heads over 2 K/V heads


def full_problem(heads=None):
    """q, k, v, dout; heads: (query heads, K/V heads), else H of each."""
    g = torch.Generator().manual_seed(0)
    hq, hkv = heads or (H, H)
    q, k, v, dout = (torch.randn(B, h, L, D, generator=g, dtype=torch.float32) for h in (hq, hkv, hkv, hq))
    return q, k, v, dout


def _worker(rank, world, impl, causal, layout="zigzag", heads=None):
    init_gloo()
    import torch.distributed as dist

    from lowbit.distributed.context_parallel import SENT

    q, k, v, dout = full_problem(heads)
    positions = torch.stack([shard_positions(L, world, r, layout) for r in range(world)])
    pos = positions[rank]
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    fn = RingAttention if impl == "ring" else RingSelfAttention
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        out = fn.apply(ql, kl, vl, positions, dist.group.WORLD, causal)
    out.backward(dout[:, :, pos])
    n = len(pos)  # kept for backward: nothing of queries x keys (this shard's or the whole sequence's)
    assert shapes and not [s for s in shapes if len(s) == 4 and s[-2] == n and s[-1] in (n, L)], shapes
    return pos, out.detach(), ql.grad, kl.grad, vl.grad, SENT["bytes"]


def _check_against_full_attention(world, impl, causal, layout="zigzag", heads=None):
    q, k, v, dout = full_problem(heads)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]  # the model's GQA: repeat_interleave, its gradient summed over the group
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=causal)
    ref.backward(dout)
    for pos, out, dq, dk, dv, _ in spawn(world, _worker, impl, causal, layout, heads):
        torch.testing.assert_close(out, ref.detach()[:, :, pos], rtol=1e-5, atol=1e-5)
        for got, full in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, full[:, :, pos], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["ring", "rsa"])
@pytest.mark.slow
def test_context_parallel_attention_equals_full_attention(impl, causal, world):
    _check_against_full_attention(world, impl, causal)


@pytest.mark.parametrize("impl", ["ring", "rsa"])
@pytest.mark.slow
def test_plain_layout_equals_full_attention(impl):
    """Rank 0 holds the first half: rank 1's block is fully masked for it (skipped), rank 0's fully allowed for
    rank 1, and each rank's own block is the diagonal: every kind of block."""
    _check_against_full_attention(2, impl, causal=True, layout="plain")


@pytest.mark.parametrize("impl", ["ring", "rsa"])
@pytest.mark.slow
def test_grouped_kv_equals_full_attention(impl):
    """K/V with fewer heads than q travel as they are and are repeated per kernel call; dK/dV summed over the
    group before they travel home: the result is full attention over the repeated K/V."""
    _check_against_full_attention(2, impl, causal=True, heads=GQA)


def _bytes_sent(world, impl, heads):
    return sum(r[-1] for r in spawn(world, _worker, impl, True, "zigzag", heads))


@pytest.mark.parametrize("impl", ["ring", "rsa"])
@pytest.mark.slow
def test_grouped_kv_sends_fewer_bytes_by_the_group_size(impl):
    """The same 4 query heads against 2 K/V heads sent as they are, or repeated to 4 heads first (what the ring
    moved before): K/V in forward and the dK/dV accumulators in backward, half the bytes."""
    grouped = _bytes_sent(2, impl, GQA)
    repeated = _bytes_sent(2, impl, (4, 4))  # 4 K/V heads: the bytes of K/V repeated to the query heads
    assert grouped > 0 and repeated == 2 * grouped


def _fp8_worker(rank, world, impl):
    """Forward bytes, then the output and gradients, of a ring that sends K/V as FP8."""
    init_gloo()
    import torch.distributed as dist

    from lowbit.distributed.context_parallel import SENT

    q, k, v, dout = full_problem(GQA)
    positions = torch.stack([shard_positions(L, world, r) for r in range(world)])
    pos = positions[rank]
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    fn = RingAttention if impl == "ring" else RingSelfAttention
    out = fn.apply(ql, kl, vl, positions, dist.group.WORLD, True, KVWire("fp8"))
    sent = SENT["bytes"]
    out.backward(dout[:, :, pos])
    return pos, out.detach(), ql.grad, kl.grad, vl.grad, sent


@pytest.mark.parametrize("impl", ["ring", "rsa"])
@pytest.mark.slow
def test_fp8_kv_is_attention_over_the_quantized_shards(impl):
    """Under cp_kv_dtype fp8 every rank attends to the dequantized K/V of every shard (its own too): the result is
    full attention over K/V quantized shard by shard, its K/V gradients passed straight through the cast; the
    forward sends a quarter of fp32's K/V bytes plus one fp32 scale per (sequence, head)."""
    world, wire = 2, KVWire("fp8")
    q, k, v, dout = full_problem(GQA)
    kq, vq = k.clone(), v.clone()
    for r in range(world):
        pos = shard_positions(L, world, r)
        kq[:, :, pos], vq[:, :, pos] = wire.local(k[:, :, pos]), wire.local(v[:, :, pos])
    assert not torch.equal(kq, k)
    q, kq, vq = (t.clone().requires_grad_() for t in (q, kq, vq))
    ref = F.scaled_dot_product_attention(q, kq.repeat_interleave(2, 1), vq.repeat_interleave(2, 1), is_causal=True)
    ref.backward(dout)
    for pos, out, dq, dk, dv, sent in spawn(world, _fp8_worker, impl):
        torch.testing.assert_close(out, ref.detach()[:, :, pos], rtol=1e-5, atol=1e-5)
        for got, full in ((dq, q.grad), (dk, kq.grad), (dv, vq.grad)):
            torch.testing.assert_close(got, full[:, :, pos], rtol=1e-5, atol=1e-5)
        per_block = B * GQA[1] * len(pos) * D + 4 * B * GQA[1]  # E4M3 bytes and the scales
        assert sent == 2 * (world - 1) * per_block  # K and V (RSA: keys in stage one, values in stage two)


def test_fp8_wire_round_trip():
    """E4M3 with a power-of-two scale per (sequence, head): within half a step of 3 mantissa bits (2^-4 relative)
    above the subnormals, exact for values already on the grid, and about half the bytes of bf16."""
    wire = KVWire("fp8")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 64, 32, generator=g) * torch.logspace(-3, 3, 4).view(1, 4, 1, 1)
    packed = wire.pack(x)
    y = wire.unpack(packed, x)
    scale_inv = packed[1].view(2, 4, 1, 1)
    assert torch.equal(torch.exp2(torch.log2(scale_inv).round()), scale_inv)  # powers of two
    err = (y - x).abs()
    assert (err <= 2 ** -4 * x.abs() + 2 ** -10 * scale_inv).all()  # 2^-10: half E4M3's subnormal step
    assert torch.equal(wire.unpack(wire.pack(y), y), y)
    xb = x.bfloat16()
    sent = sum(t.numel() * t.element_size() for t in wire.pack(xb))
    assert sent == xb.numel() + 4 * 8 and sent <= 0.51 * xb.numel() * 2
    assert wire.unpack(wire.pack(xb), xb).dtype == torch.bfloat16
    assert KVWire("auto").pack(x)[0] is x


def test_cp_kv_dtype_is_checked():
    with pytest.raises(LowbitError, match="cp_kv_dtype"):
        KVWire("bf16")
    with pytest.raises(LowbitError, match=r"parallel.cp_kv_dtype \(fp8\): .* parallel.cp > 1"):
        load_config(None, ["--parallel.cp_kv_dtype", "fp8"])


def test_zigzag_balances_causal_work():
    pos = [zigzag_positions(32, 4, r) for r in range(4)]
    assert sorted(torch.cat(pos).tolist()) == list(range(32))
    work = [sum(int(p) + 1 for p in ps) for ps in pos]  # keys each rank's queries attend to
    assert len(set(work)) == 1


def test_plain_positions_are_contiguous_chunks():
    assert [shard_positions(12, 3, r, "plain").tolist() for r in range(3)] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                                               [8, 9, 10, 11]]
    assert torch.equal(shard_positions(12, 3, 1), zigzag_positions(12, 3, 1))  # zigzag is the default
