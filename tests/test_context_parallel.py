"""Ring attention and ring self-attention (2 and 4 gloo processes) equal full attention, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from distributed_util import init_gloo, spawn

from lowbit.distributed.context_parallel import RingAttention, RingSelfAttention, zigzag_positions

B, H, L, D = 2, 3, 24, 8


def full_problem():
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, L, D, generator=g, dtype=torch.float32) for _ in range(4))
    return q, k, v, dout


def _worker(rank, world, impl, causal):
    init_gloo()
    import torch.distributed as dist

    q, k, v, dout = full_problem()
    pos = zigzag_positions(L, world, rank)
    positions = torch.stack([zigzag_positions(L, world, r) for r in range(world)])
    ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    fn = RingAttention if impl == "ring" else RingSelfAttention
    out = fn.apply(ql, kl, vl, positions, dist.group.WORLD, causal)
    out.backward(dout[:, :, pos])
    return pos, out.detach(), ql.grad, kl.grad, vl.grad


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("impl", ["ring", "rsa"])
def test_context_parallel_attention_equals_full_attention(impl, causal, world):
    q, k, v, dout = full_problem()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref.backward(dout)
    for pos, out, dq, dk, dv in spawn(world, _worker, impl, causal):
        torch.testing.assert_close(out, ref.detach()[:, :, pos], rtol=1e-5, atol=1e-5)
        for got, full in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
            torch.testing.assert_close(got, full[:, :, pos], rtol=1e-5, atol=1e-5)


def test_zigzag_balances_causal_work():
    pos = [zigzag_positions(32, 4, r) for r in range(4)]
    assert sorted(torch.cat(pos).tolist()) == list(range(32))
    work = [sum(int(p) + 1 for p in ps) for ps in pos]  # keys each rank's queries attend to
    assert len(set(work)) == 1
