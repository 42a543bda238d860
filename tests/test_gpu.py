"""GPU-only checks (skipped without CUDA): the bf16 path, flash/efficient attention, fused AdamW, compile."""

import pytest
import torch

from lowbit.models.llama import Llama, ModelArgs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_bf16_sdpa_keeps_no_seq_by_seq_tensor_on_gpu():
    seq = 4096
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=512, max_seq_len=seq)
    model = Llama(args).cuda()
    x = torch.randint(0, 512, (1, seq), device="cuda")
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x)
    loss.backward()
    assert not [s for s in shapes if sum(d >= seq for d in s) >= 2]


def test_compiled_bf16_matches_eager_loss():
    torch.manual_seed(0)
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=1, ffn_dim=704, vocab_size=512, max_seq_len=256)
    model = Llama(args).cuda()
    x = torch.randint(0, 512, (4, 256), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(x, x).item()
        compiled = torch.compile(model)(x, x).item()
    assert abs(eager - compiled) < 2e-2
