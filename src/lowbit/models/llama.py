"""LLaMA (Touvron et al. 2023) in plain PyTorch: pre-normalization with RMSNorm, SwiGLU, rotary embeddings,
grouped-query attention, no biases. Knows nothing of low precision or parallelism: those layers are applied to a
built model from outside (lowbit.numerics.recipes.convert, lowbit.distributed).

Weight layout follows HF transformers' LlamaForCausalLM (rotate-half RoPE), so export is a renaming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from lowbit.errors import LowbitError
from lowbit.models.init import init_parameters, param_seed
from lowbit.models.performer import Performer, default_features

# Architecture presets. `1b` is exactly TinyLlama-1.1B; `7b` and `13b` are LLaMA-7B and LLaMA-13B. vocab_size None:
# from the tokenizer.
PRESETS: dict[str, dict] = {
    "tiny": dict(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_multiple_of=32, vocab_size=None,
                 rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True),
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_multiple_of=256, vocab_size=32000,
                 rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "350m": dict(dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, ffn_multiple_of=256, vocab_size=32000,
                 rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "1b": dict(dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632, ffn_multiple_of=256,
               vocab_size=32000, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    "7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, ffn_multiple_of=256,
               vocab_size=32000, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False),
    "13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, ffn_multiple_of=256,
                vocab_size=32000, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False),
}


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    attention: str = "sdpa"
    sdpa_backend: str = "auto"
    performer_features: int | None = None  # None: default_features(head_dim)
    performer_chunk: int = 256
    performer_redraw: int = 1000
    checkpointing: str = "none"
    dropout: float = 0.0  # SDPA's attention weights and each block's two residual branches; training only

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def swiglu_hidden(dim: int, multiple_of: int) -> int:
    """LLaMA's SwiGLU width: 2/3 of 4*dim (same parameters as a 4*dim MLP), rounded up to a multiple."""
    hidden = int(2 * (4 * dim) / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


def resolve_model_args(model_cfg, vocab_size: int, seq_len: int) -> ModelArgs:
    """Merge a ModelConfig (None = from preset) with its preset, the tokenizer's vocabulary and the sequence
    length, and check the shape. `vocab_size` is the tokenizer's; the embedding may be larger, never smaller."""
    if model_cfg.preset not in PRESETS:
        raise LowbitError(f"model.preset: {model_cfg.preset!r} is not one of {', '.join(PRESETS)}")
    p = dict(PRESETS[model_cfg.preset])
    for f in fields(model_cfg):
        v = getattr(model_cfg, f.name)
        if f.name != "preset" and v is not None:
            p[f.name] = v
    if p.get("ffn_dim") is None:
        p["ffn_dim"] = swiglu_hidden(p["dim"], p["ffn_multiple_of"])
    if p.get("vocab_size") is None:
        p["vocab_size"] = 64 * math.ceil(vocab_size / 64)
    if p["vocab_size"] < vocab_size:
        raise LowbitError(f"model.vocab_size ({p['vocab_size']}) is smaller than the tokenizer's vocabulary "
                          f"({vocab_size}): raise model.vocab_size or use a smaller tokenizer")
    if p["dim"] % p["n_heads"]:
        raise LowbitError(f"model.dim ({p['dim']}) must be divisible by model.n_heads ({p['n_heads']})")
    if p["n_heads"] % p["n_kv_heads"]:
        raise LowbitError(f"model.n_heads ({p['n_heads']}) must be divisible by model.n_kv_heads "
                          f"({p['n_kv_heads']})")
    if (p["dim"] // p["n_heads"]) % 2:
        raise LowbitError(f"head dim model.dim/model.n_heads ({p['dim'] // p['n_heads']}) must be even for RoPE")
    max_seq_len = p.get("max_seq_len") or seq_len
    if max_seq_len < seq_len:
        raise LowbitError(f"model.max_seq_len ({max_seq_len}) is shorter than data.seq_len ({seq_len})")
    names = {f.name for f in fields(ModelArgs)}
    return ModelArgs(**{k: v for k, v in dict(p, max_seq_len=max_seq_len).items() if k in names})


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rstd), rstd = 1/sqrt(mean(x²) + eps) per row, in fp32 whatever x's dtype (the mean of squares
    loses too much in bf16). Autograd of that formula keeps fp32 copies of x and of the normalized rows; this keeps
    x as it came (through `codec`, if one is set: see SwiGLU) and the fp32 rstd of each row."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, codec=None):
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        ctx.codec, ctx.x_dtype = codec, x.dtype
        ctx.save_for_backward(rstd, weight, *(codec.pack(x) if codec else (x,)))
        return weight * (h * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        rstd, weight, *packed = ctx.saved_tensors
        x = ctx.codec.unpack(*packed, ctx.x_dtype) if ctx.codec else packed[0]
        dx, dw = rmsnorm_backward(dy, x, rstd, weight, *ctx.needs_input_grad[:2])
        return dx, dw, None, None


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, need_dx: bool,
                     need_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight) of RMSNorm's output gradient `dy`, from its input `x` and the fp32 `rstd` of each row (None
    where not needed). Public so that a module computing the same forward another way has the same backward."""
    h = x.float()
    n = (h * rstd).to(x.dtype)
    dx = dw = None
    if need_dw:
        dw = (dy.float() * n.float()).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
    if need_dx:
        # autograd rounds d(normalized) to x's dtype before the fp32 part (the cast's backward): so do we
        dn = (dy * weight).to(x.dtype).float()
        dot = (dn * h).sum(-1, keepdim=True)
        dx = (dn * rstd - h * (rstd.pow(3) * dot / h.shape[-1])).to(x.dtype)
    return dx, dw


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.codec = None  # how x is kept for backward (None: as it came); a numerics recipe may set one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # nothing is kept without grad (validation, generation): packing would be wasted work
        return _RMSNorm.apply(x, self.weight, self.eps, self.codec if torch.is_grad_enabled() else None)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each [max_seq_len, head_dim], in the rotate-half layout (frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, L, D]; rotates pairs (i, i + D/2) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def sdpa_order(backend: str, q: torch.Tensor) -> list[SDPBackend] | None:
    """The SDPA kernels to allow: None (auto) for torch's own choice (cuDNN's on an H200 with torch 2.11, measured),
    else the one named, so that kernels can be compared or one avoided."""
    if backend == "auto":
        return None
    if backend in ("cudnn", "efficient") and not q.is_cuda:
        raise LowbitError(f"model.sdpa_backend={backend} runs on CUDA only, not on {q.device.type}")
    return [SDPA_BACKENDS[backend]]


class CausalSDPA(nn.Module):
    """Exact causal attention: flash / memory-efficient kernels skip masked blocks and store no attention weights."""

    def __init__(self, backend: str = "auto", dropout: float = 0.0):
        super().__init__()
        if backend != "auto" and backend not in SDPA_BACKENDS:
            raise LowbitError(f"model.sdpa_backend: {backend!r} is not one of auto, {', '.join(SDPA_BACKENDS)}")
        self.backend, self.dropout = backend, dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions=None) -> torch.Tensor:
        order = sdpa_order(self.backend, q)
        # dropout_p only when set: a run without dropout calls SDPA exactly as before
        kw = {"dropout_p": self.dropout} if self.dropout and self.training else {}
        if order is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        with sdpa_kernel(order):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)


class Attention(nn.Module):
    """Projections, RoPE and GQA around an attention core [B, H, L, D] -> [B, H, L, D]: CausalSDPA or Performer;
    context parallelism swaps in its own (lowbit.distributed.context_parallel). K/V reach the core repeated to H
    heads (head j of the group of query heads j·rep .. j·rep+rep−1, repeat_interleave), unless the core says
    `grouped_kv`: then with n_kv_heads heads, and the core repeats them the same way."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.core = Performer(a.head_dim, a.performer_features or default_features(a.head_dim), a.performer_chunk) \
            if a.attention == "performer" else CausalSDPA(a.sdpa_backend, a.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions=None) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.wq(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # before any feature map
        # a core marked grouped_kv takes K/V with n_kv_heads heads and repeats them itself, where it needs them
        if self.n_kv_heads != self.n_heads and not getattr(self.core, "grouped_kv", False):
            # Expanded views keep every SDPA backend available (flash included); no seq x seq tensor is formed.
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = self.core(q, k, v, positions)
        return self.wo(out.transpose(1, 2).reshape(B, L, -1))


class _SiluMul(torch.autograd.Function):
    """silu(a) * b. Autograd keeps a, silu(a) and b; this keeps a and b and recomputes silu(a) in backward. Its
    gradients are autograd's own kernels on the same values, so they are equal to the plain formula's."""

    @staticmethod
    def forward(ctx, a, b, codec=None):
        ctx.codec, ctx.dtypes = codec, (a.dtype, b.dtype)
        pa, pb = (codec.pack(a), codec.pack(b)) if codec else ((a,), (b,))
        ctx.n_a = len(pa)
        ctx.save_for_backward(*pa, *pb)
        return F.silu(a) * b

    @staticmethod
    def backward(ctx, dy):
        saved, n = ctx.saved_tensors, ctx.n_a
        a, b = (ctx.codec.unpack(*saved[:n], ctx.dtypes[0]), ctx.codec.unpack(*saved[n:], ctx.dtypes[1])) \
            if ctx.codec else saved
        return (*silu_mul_backward(dy, a, b, *ctx.needs_input_grad[:2]), None)


def silu_mul_backward(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor, need_da: bool,
                      need_db: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(da, db) of silu(a)·b for its output gradient `dy` (None where not needed). Public so that a module
    computing the same forward another way has the same backward."""
    # each product cast to its input's dtype, as autograd's mul backward does
    da = torch.ops.aten.silu_backward((dy * b).to(a.dtype), a) if need_da else None
    db = (dy * F.silu(a)).to(b.dtype) if need_db else None
    return da, db


class SwiGLU(nn.Module):
    """silu(a) * b, keeping only a and b for backward. `codec` (None: kept as they are) is how a numerics recipe may
    store them instead (an object with pack(t) -> tensors and unpack(*tensors, dtype) -> t; lowbit.numerics.activations);
    this model knows no format."""

    def __init__(self):
        super().__init__()
        self.codec = None

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _SiluMul.apply(a, b, self.codec if torch.is_grad_enabled() else None)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.act = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act(self.w1(x), self.w3(x)))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)
        self.checkpointing = a.checkpointing
        self.dropout = a.dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions=None) -> torch.Tensor:
        """The block under the activation checkpointing policy. Applied here, inside the block, so that a block
        compiled on its own (lowbit.train.compile) traces the checkpoint and recomputes within its graph."""
        if self.training and self.checkpointing == "full":
            return checkpoint(self.compute, x, cos, sin, positions, use_reentrant=False)
        if self.training and self.checkpointing == "selective":
            return checkpoint(self.compute, x, cos, sin, positions, use_reentrant=False,
                              context_fn=_selective_policy)
        return self.compute(x, cos, sin, positions)

    def compute(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions=None) -> torch.Tensor:
        h = x + self.residual(self.attention(self.attention_norm(x), cos, sin, positions))
        return h + self.residual(self.feed_forward(self.ffn_norm(h)))

    def residual(self, branch: torch.Tensor) -> torch.Tensor:
        """A residual branch's output, under dropout while training (none at all when model.dropout is 0). A
        checkpointed block recomputes it with the RNG state of the first pass (torch.utils.checkpoint keeps it), so
        the masks agree."""
        return F.dropout(branch, self.dropout, training=True) if self.dropout and self.training else branch


def _selective_policy():
    """Selective checkpointing: keep what the matmuls and attention produced, recompute the elementwise rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    keep = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_mm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        if hasattr(aten, name):
            keep.add(getattr(aten, name).default)
    if hasattr(torch.ops.lowbit, "fp8_attention"):  # numerics.fp8_attention's core, where it is loaded
        keep.add(torch.ops.lowbit.fp8_attention.default)

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class Llama(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        # the base seed of the init streams, drawn first: the submodules' own default inits draw after it
        self.init_seed = int(torch.randint(0, 1 << 62, (), dtype=torch.int64, device="cpu"))
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = None if a.tie_embeddings else nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("rope_cos", torch.empty(a.max_seq_len, a.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(a.max_seq_len, a.head_dim), persistent=False)
        if self.rope_cos.device.type != "meta":  # on meta: lowbit.models.init.materialize initializes later
            self.init_buffers()
            self.reset_parameters()

    def init_buffers(self) -> None:
        cos, sin = rope_tables(self.args.head_dim, self.args.max_seq_len, self.args.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def reset_parameters(self) -> None:
        """GPT-2/LLaMA-style init: N(0, std) everywhere, residual projections (wo, w2) scaled by 1/sqrt(2L); each
        tensor from its own stream (lowbit.models.init), seeded by the global RNG."""
        std, n_layers = self.args.init_std, self.args.n_layers

        def std_of(name: str) -> float | None:
            if name.endswith("norm.weight"):
                return None  # ones
            return std / math.sqrt(2 * n_layers) if name.endswith(("wo.weight", "w2.weight")) else std

        init_parameters(self, std_of, self.init_seed)
        g = torch.Generator().manual_seed(param_seed(self.init_seed, "performer features"))
        for m in self.modules():  # a stream apart, so a performer model starts from the sdpa model's weights
            if isinstance(m, Performer):
                m.redraw(g)

    def __getstate__(self):
        # a copy or pickle drops a compiled `head` bound to this instance (lowbit.train.compile); it runs eagerly
        state = super().__getstate__()
        state.pop("head", None)
        return state

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, L, V] or, with targets, the mean cross-entropy (computed in fp32). `positions` [L]: where
        the tokens sit in their sequence (a context-parallel shard); default 0..L-1."""
        L = tokens.shape[1]
        if L > self.args.max_seq_len:
            raise ValueError(f"sequence of {L} tokens is longer than max_seq_len {self.args.max_seq_len}")
        cos, sin = (self.rope_cos[:L], self.rope_sin[:L]) if positions is None else \
            (self.rope_cos[positions], self.rope_sin[positions])
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin, positions)
        return self.head(h, targets)

    def head(self, h: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm and output projection: logits, or with targets the mean cross-entropy in fp32."""
        h = self.norm(h)
        logits = h @ self.head_weight().t() if self.output is None else self.output(h)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self, embeddings: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n if embeddings else n - self.tok_embeddings.weight.numel()

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (PaLM appendix B): 6 N (matmul weights, output head included, input embedding
        not) + 12 L d T for attention scores and values, counted as if unmasked, as is conventional; for performer
        attention, its feature maps, chunk scores and running state instead of the 12 L d T."""
        a = self.args
        n = self.num_params(embeddings=False) + (a.vocab_size * a.dim if a.tie_embeddings else 0)
        if a.attention == "performer":  # per head: q, k features (2·M·d each), chunk scores and values, state
            m, d, c = a.performer_features or default_features(a.head_dim), a.head_dim, min(a.performer_chunk,
                                                                                                 seq_len)
            per_head = 2 * (2 * m * d) + 2 * c * (m + d + 1) + 2 * 2 * m * (d + 1)
            return 6 * n + 3 * a.n_layers * a.n_heads * per_head
        return 6 * n + 12 * a.n_layers * a.dim * seq_len
