"""numerics.fused_producers: the norms and SwiGLU hand FP8 to the linears they feed; the step is the unfused one
bit for bit on the CPU (the producers' CPU kernels are the model's formulas), and the config refuses where it does
not apply."""

import dataclasses

import pytest
import torch

from conftest import SMALL, assert_user_error, cli, losses
from lowbit.library import unconvert
from lowbit.models.llama import Llama, ModelArgs, RMSNorm, SwiGLU
from lowbit.numerics import kernels
from lowbit.numerics.fused_producers import FP8RMSNorm, FP8SwiGLU
from lowbit.numerics.recipes import convert, get_recipe
from lowbit.numerics.scaling import scale_from_amax

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=96, max_seq_len=16)


def build(fused: bool, recipe: str = "fp8-tensorwise", **args) -> tuple[Llama, dict]:
    torch.manual_seed(0)
    model = Llama(dataclasses.replace(ARGS, **args))
    return model, convert(model, dataclasses.replace(get_recipe(recipe), fused_producers=fused))


def step(model, run=None, autocast: bool = False):
    """One forward and backward: (loss, {name: grad}, state_dict after the scaling states recorded)."""
    x = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = (model if run is None else run)(x[:, :-1], x[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, model.state_dict()


def assert_same(a, b):
    assert torch.equal(a[0], b[0]), (a[0], b[0])
    assert [n for n in a[1] if not torch.equal(a[1][n], b[1][n])] == []
    assert [k for k in a[2] if not torch.equal(a[2][k], b[2][k])] == []  # scaling states included


def test_install_replaces_the_producers_that_feed_fp8_linears():
    model, report = build(True)
    assert report["fused"] == [f"layers.{i}.{m}" for i in range(2)
                               for m in ("attention_norm", "ffn_norm", "feed_forward.act")]
    assert report["unfused"] == []
    assert isinstance(model.layers[0].attention_norm, FP8RMSNorm)
    assert isinstance(model.layers[1].feed_forward.act, FP8SwiGLU)
    assert type(model.norm) is RMSNorm  # the final norm feeds the (high-precision) head
    keys = set(build(False)[0].state_dict())
    assert set(model.state_dict()) == keys
    # a producer feeding a linear kept in high precision stays plain
    report = convert(_plain(), dataclasses.replace(get_recipe("fp8-tensorwise"), fused_producers=True, keep=("w2",)))
    assert "layers.0.feed_forward.act (a linear it feeds stays high precision)" in report["unfused"]
    assert "layers.0.ffn_norm" in report["fused"]


def steps(model, n: int):
    """n forwards and backwards, each on its own tokens (amaxes change, so a delayed scale differs from the
    current one): every step's (loss, {name: grad}, state_dict)."""
    out = []
    for i in range(n):
        x = torch.randint(0, ARGS.vocab_size, (2, 17), generator=torch.Generator().manual_seed(i))
        loss = model(x[:, :-1], x[:, 1:]) * (1 + i)
        loss.backward()
        out.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                    {k: v.clone() for k, v in model.state_dict().items()}))
        model.zero_grad()
    return out


@pytest.mark.parametrize("recipe", ["fp8-delayed", "fp8lm"])
def test_delayed_fused_steps_are_the_unfused_steps_bit_for_bit(recipe):
    """Delayed scaling: the producers cast with the fed linears' delayed scale in one pass and report the amax
    they measured (the norm: its amax pass's); in warm-up (fp8-delayed: the first step; fp8lm: 16 steps) with the
    current scale of SwiGLU's gated amax pass. Over 20 steps on changing tokens (past fp8lm's warm-up), loss, gradients and every scaling state are
    the unfused path's bit for bit."""
    unfused, fused = build(False, recipe)[0], build(True, recipe)[0]
    assert "tensor/delayed" in repr(fused.layers[0].attention_norm)
    for i, (a, b) in enumerate(zip(steps(unfused, 20), steps(fused, 20))):
        assert_same(a, b)
    state = fused.layers[0].feed_forward.w2.scaling["input"]
    assert int(state.updates) == 20 and int((state.amax_history > 0).sum()) == min(20, state.spec.history)
    # the delayed scale was used: the last step's scale is the window's (max over 20 amaxes), not its own amax's
    assert not torch.equal(state.scale, scale_from_amax(state.amax_history[:1], state.spec)[0][0])


def test_gated_amax_pass_is_zero_where_the_gate_is_off():
    a, b = (torch.randn(8, 16) for _ in range(2))
    for gate, want in ((True, 1), (False, 0)):
        assert (torch.ops.lowbit.swiglu_amax(a, b, torch.tensor(gate)) > 0) == bool(want)
    assert torch.equal(torch.ops.lowbit.swiglu_amax(a, b, torch.tensor(True)), torch.ops.lowbit.swiglu_amax(a, b))


def _plain() -> Llama:
    torch.manual_seed(0)
    return Llama(ARGS)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_fused_step_is_the_unfused_step_bit_for_bit(autocast, checkpointing):
    """Loss, every parameter gradient and every scaling state after one step: equal bit for bit."""
    unfused, _ = build(False, checkpointing=checkpointing)
    fused, _ = build(True, checkpointing=checkpointing)
    assert_same(step(unfused, autocast=autocast), step(fused, autocast=autocast))


def test_fused_step_keeps_the_saved_activation_codec():
    """fp8-tensorwise-coat: the fused modules keep the norms' and SwiGLU's inputs through the recipe's codec."""
    unfused, _ = build(False, "fp8-tensorwise-coat")
    fused, _ = build(True, "fp8-tensorwise-coat")
    assert fused.layers[0].ffn_norm.codec is not None
    assert_same(step(unfused), step(fused))


def test_no_grad_forward_and_unconvert():
    unfused, _ = build(False)
    fused, _ = build(True)
    x = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(unfused(x), fused(x))
    weight = fused.layers[0].attention_norm.weight
    unconvert(fused)
    assert fused.layers[0].attention_norm.weight is weight
    assert type(fused.layers[0].attention_norm) is RMSNorm and type(fused.layers[0].feed_forward.act) is SwiGLU
    with torch.no_grad():
        plain = _plain()
        plain.load_state_dict(fused.state_dict())
        assert torch.equal(plain(x), fused(x))


def _saved_fp8_shapes(model) -> list[tuple[int, ...]]:
    """The shapes of the FP8 tensors one training forward saves for backward."""
    shapes = []

    def pack(t):
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            shapes.append(tuple(t.shape))
        return t

    x = torch.randint(0, ARGS.vocab_size, (3, 16), generator=torch.Generator().manual_seed(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, x)
    return shapes


def test_producers_write_the_transposed_copy_backward_keeps():
    """The FP8 copies kept for the weight gradients are the producers' transposed ones ([K, tokens]), as the
    unfused linears' cast_transpose keeps; a producer feeding a linear whose weight gradient is high precision
    writes none (and its step is that linear's unfused step)."""
    unfused, fused = build(False)[0], build(True)[0]
    tokens, dim, ffn = 48, ARGS.dim, ARGS.ffn_dim
    # per layer: wq, wk, wv (the attention norm's one copy, saved three times), w1 and w3, w2; wo's input is cast
    # by wo itself (row-major on the CPU, where cast_transpose is a cast and a view)
    fed = [(dim, tokens)] * 5 + [(ffn, tokens)]
    assert sorted(s for s in _saved_fp8_shapes(fused) if tokens in s) == \
        sorted((fed + [(tokens, dim)]) * ARGS.n_layers)
    assert sorted(s for s in _saved_fp8_shapes(unfused) if tokens in s) == \
        sorted(([(k, m) for m, k in fed] + [(tokens, dim)]) * ARGS.n_layers)
    assert "transposed" in repr(fused.layers[0].feed_forward.act)

    from lowbit.numerics.fused_producers import install_fused_producers
    models = []
    for fuse in (False, True):
        model = build(False)[0]
        w2 = model.layers[0].feed_forward.w2
        w2.recipe = dataclasses.replace(w2.recipe, wgrad_hp=True)
        if fuse:
            install_fused_producers(model)
            assert not model.layers[0].feed_forward.act.transpose and model.layers[1].feed_forward.act.transpose
        models.append(model)
    assert_same(step(models[0]), step(models[1]))


def rel_diffs(a, b) -> dict[str, float]:
    """|a - b| / |b| of the loss and of each gradient."""
    out = {"loss": ((a[0] - b[0]).abs() / b[0].abs()).item()}
    out.update({n: ((a[1][n] - g).norm() / g.norm()).item() for n, g in b[1].items()})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_fused_step_compiled(recipe):
    """Compiled, the producers are opaque calls of the CPU formulas (eager torch), while inductor compiles the
    unfused norm's forward and both backwards with its own reduction orders: an rstd, and so an amax and a scale,
    may differ in the last bit, and a norm weight's gradient (a sum over tokens) in the last bits. Bounded: the
    fused compiled step is within 1e-5 (loss) and 1e-4 (each gradient, relative norm) of the unfused compiled one
    and of its own eager step (measured against the unfused compiled step: the loss and every linear's gradient
    equal, the norm weights' and the embedding's within 1e-7)."""
    runs = {}
    for fused in (False, True):
        model, _ = build(fused, recipe, n_layers=1)
        runs[fused] = step(model, torch.compile(model))
        torch._dynamo.reset()
    eager_model, _ = build(True, recipe, n_layers=1)
    eager = step(eager_model)
    for other in (runs[False], eager):
        diffs = rel_diffs(runs[True], other)
        assert diffs.pop("loss") <= 1e-5
        assert max(diffs.values()) <= 1e-4, diffs


@pytest.mark.parametrize("recipe, needle", [
    ("fp8-rowwise", "per row"), ("fp8-blockwise", "per block"),
    ("mxfp8", "per mx"), ("fp4", "per row"), ("bf16", "no low-precision linears"),
])
def test_config_refuses_where_it_does_not_apply(capsys, recipe, needle):
    assert_user_error(capsys, ["train", "--recipe", recipe, "--numerics.fused_producers", "true"],
                      "numerics.fused_producers", needle)


def test_config_refuses_tensor_parallelism_and_takes_delayed_scaling(capsys):
    assert_user_error(capsys, ["train", "--recipe", "fp8-tensorwise", "--numerics.fused_producers", "true",
                               "--parallel.tp", "2"], "numerics.fused_producers", "parallel.tp")
    from lowbit.numerics.fused_producers import unsupported
    from lowbit.numerics.recipes import with_scaling
    for recipe in (get_recipe("fp8-delayed"), get_recipe("fp8lm-o2"),
                   with_scaling(get_recipe("fp8-tensorwise"), "delayed", 16, 1, 0)):
        assert unsupported(recipe.linear) is None, recipe.name


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8lm-o2"])
def test_train_with_fused_producers_from_the_command_line(tmp_path, capsys, recipe):
    """A short run with the knob is the run without it, loss for loss (fp8lm-o2: delayed input scales)."""
    base = [*SMALL, "--recipe", recipe, "--train.steps", "4", "--train.eval_every", "0",
            "--numerics.telemetry_every", "2"]  # telemetry steps too: their inputs have no statistics
    code, out, _ = cli(capsys, "train", *base, "--numerics.fused_producers", "true", "--run.dir", tmp_path / "on")
    assert code == 0
    assert "numerics.fused_producers: 6 norms and SwiGLUs write FP8; unfused: none" in out
    assert cli(capsys, "train", *base, "--run.dir", tmp_path / "off")[0] == 0
    assert losses(tmp_path / "on") == losses(tmp_path / "off")


@pytest.mark.slow
def test_bench_step_variant_fuses_the_producers(tmp_path, capsys, monkeypatch):
    """`lowbit bench step --recipes fp8-tensorwise+numerics.fused_producers=true` converts with the producers."""
    import json

    import lowbit.numerics.recipes as recipes

    fused = []
    real = recipes.convert
    monkeypatch.setattr(recipes, "convert", lambda model, recipe: fused.append(
        len((out := real(model, recipe)).get("fused", []))) or out)
    out = tmp_path / "step.json"
    variant = "fp8-tensorwise+numerics.fused_producers=true"
    code, _, _ = cli(capsys, "bench", "step", "--device", "cpu", "--steps", "1", "--warmup", "0", "--preset",
                     "tiny", "--batch", "2", "--seq", "16", "--vocab", "256", "--torchao", "none", "--no-bf16",
                     "--recipes", f"fp8-tensorwise,{variant}", "--out", out)
    assert code == 0
    assert fused == [0, 12]  # tiny: 4 blocks x (2 norms + SwiGLU)
    rows = json.loads(out.read_text())["tables"]["step"]["rows"]
    assert all("error" not in r for r in rows), rows


_NORM = ["*bf16", "*fp32", "*fp8e4nv", "*fp32", "*fp32", "*fp32", "i32", "i32", "fp64"]
_NORM_SCALARS = {"M": 16384, "N": 2048, "eps": 1e-5}
SIGNATURES = {  # the producers' kernels: (pointer and scalar types, scalars to hand over as constants, constexprs)
    "_rmsnorm_fp8_kernel": (_NORM, _NORM_SCALARS, dict(FMT_MAX=448.0, OUT_W_DTYPE=False, STORE=True, AMAX=True,
                                                       BLOCK=2048, RSTD_GIVEN=False)),
    "_rmsnorm_fp8_kernel rstd given": (_NORM, _NORM_SCALARS, dict(FMT_MAX=448.0, OUT_W_DTYPE=False, STORE=True,
                                                                  AMAX=False, BLOCK=2048, RSTD_GIVEN=True)),
    "_swiglu_fp8_kernel": (["*bf16", "*bf16", "*fp8e4nv", "*fp32", "*fp32", "*fp32", "i32"], {"n": 1 << 20},
                           dict(FMT_MAX=448.0, STORE=True, AMAX=True, BLOCK=2048, GATED=False)),
    "_swiglu_fp8_kernel gated": (["*bf16", "*bf16", "*fp8e4nv", "*fp32", "*fp32", "*fp32", "i32"], {"n": 1 << 20},
                                 dict(FMT_MAX=448.0, STORE=False, AMAX=True, BLOCK=2048, GATED=True)),
}


@pytest.mark.skipif(kernels.triton is None, reason="needs Triton")
@pytest.mark.parametrize("kernel", SIGNATURES)
@pytest.mark.parametrize("scalars", ["launched", "constants"])
def test_producer_kernels_build_for_hopper_with_scalars_handed_either_way(kernel, scalars):
    """torch.compile hands a triton_op's kernel its scalars two ways: inductor's launch passes a float as fp64, and
    its analysis of what the kernel writes may pass them as Python numbers (a kernel calling `N.to(...)` failed
    there, and torch then took every input as written). Each producer kernel builds to Triton IR for sm90 both
    ways; no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend

    from lowbit.numerics import producers

    fn = getattr(producers, kernel.split()[0])
    types, numbers, constexprs = SIGNATURES[kernel]
    constants = {**constexprs, **(numbers if scalars == "constants" else {})}
    signature = {**dict(zip(fn.arg_names, types)), **{name: "constexpr" for name in constants}}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(fn, signature, {(fn.arg_names.index(k),): v for k, v in constants.items()})
    src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


SIGNATURES.update({
    "_rmsnorm_fp8_t_kernel": (["*bf16", "*fp32", "*fp32", "*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32", "i32", "i32"],
                              {"M": 16384, "N": 2048}, dict(FMT_MAX=448.0, OUT_W_DTYPE=False, AMAX=False, BM=32,
                                                            BN=128)),
    "_swiglu_fp8_t_kernel": (["*bf16", "*bf16", "*fp8e4nv", "*fp8e4nv", "*fp32", "*fp32", "i32", "i32"],
                             {"M": 16384, "N": 5632}, dict(FMT_MAX=448.0, AMAX=True, BM=32, BN=128)),
})

@pytest.mark.skipif(kernels.triton is None, reason="needs Triton")
def test_compiles_analysis_finds_each_producer_kernel_writing_only_its_outputs(monkeypatch):
    """torch.compile reads a triton_op's kernel (its Triton IR for the GPU's target) to learn which tensors it
    writes; where that analysis fails it takes every input as written and copies them first (a norm kernel once
    did). Each producer kernel, loops and all, is found to write exactly its outputs; no GPU needed (a Hopper
    target given in place of the driver's)."""
    import triton
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    from triton.backends.compiler import GPUTarget

    from lowbit.numerics import producers as p

    monkeypatch.setattr(triton.runtime.driver, "_active",
                        type("Hopper", (), {"get_current_target": lambda self: GPUTarget("cuda", 90, 32)})())
    M, N = 256, 512
    a, b, x = (torch.empty(M, N, dtype=torch.bfloat16) for _ in range(3))
    w, scale, stats, rstd, gate = torch.ones(N), torch.ones(1), torch.zeros(2), torch.empty(M, 1), torch.ones(1)
    y, yt = torch.empty(M, N, dtype=torch.float8_e4m3fn), torch.empty(N, M, dtype=torch.float8_e4m3fn)
    part = torch.empty(64, 2)
    row = dict(FMT_MAX=448.0, STORE=True, AMAX=True, stats_ptr=stats)
    gated = dict(GATED=False, gate_ptr=gate)
    norm = dict(x_ptr=x, w_ptr=w, y_ptr=y, rstd_ptr=rstd, scale_ptr=scale, M=M, N=N, eps=1e-5, OUT_W_DTYPE=False,
                BLOCK=N)
    tile = dict(y_ptr=y, yt_ptr=yt, scale_ptr=scale, part_ptr=part, M=M, N=N, FMT_MAX=448.0, BM=32, BN=128)
    cases = {
        "_swiglu_fp8_kernel": (dict(a_ptr=a, b_ptr=b, y_ptr=y, scale_ptr=scale, n=M * N, BLOCK=2048, **row,
                                    **gated), {"y_ptr", "stats_ptr"}),
        "_swiglu_fp8_kernel gated": (dict(a_ptr=a, b_ptr=b, y_ptr=y, scale_ptr=scale, n=M * N, BLOCK=2048,
                                          **{**row, "STORE": False}, **{**gated, "GATED": True}), {"stats_ptr"}),
        "_rmsnorm_fp8_kernel": (dict(RSTD_GIVEN=False, **norm, **row), {"y_ptr", "rstd_ptr", "stats_ptr"}),
        "_rmsnorm_fp8_kernel rstd given": (dict(RSTD_GIVEN=True, **norm, **{**row, "AMAX": False}), {"y_ptr"}),
        "_swiglu_fp8_t_kernel": (dict(a_ptr=a, b_ptr=b, AMAX=True, **tile), {"y_ptr", "yt_ptr", "part_ptr"}),
        "_rmsnorm_fp8_t_kernel": (dict(x_ptr=x, w_ptr=w, rstd_ptr=rstd, OUT_W_DTYPE=False, AMAX=False, **tile),
                                  {"y_ptr", "yt_ptr"}),
    }
    assert set(cases) == set(SIGNATURES)
    for name, (kwargs, written) in cases.items():
        kernel = getattr(p, name.split()[0])
        if hasattr(wrap, "identify_accessed_tensors"):  # torch 2.13
            found = {d.name for d in wrap.identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes}
        else:  # torch 2.11
            found = set(wrap.identify_mutated_tensors(kernel, kwargs, {}))
        assert found == written, name


TRANSPOSING_CHECK = r"""
import types

import torch
import triton
import triton.language as tl
from lowbit.numerics import producers as p


@triton.jit
def _exp(x):
    return tl.exp(x)


@triton.jit
def _rsqrt(x):
    return tl.math.rsqrt(x)


@triton.jit
def _mul(a, b):
    return a * b


@triton.jit
def _add(a, b):
    return a + b


# the interpreter runs no libdevice: tl's own math in its place, the same in every kernel compared here
p.libdevice = types.SimpleNamespace(exp=_exp, rsqrt=_rsqrt, mul_rn=_mul, add_rn=_add)
torch.manual_seed(0)
M, N, B = 70, 100, 32  # tiles of 32 x 32: the last row and column of tiles are partial
fmax = 57344.0
f8 = torch.float8_e5m2
scale = torch.tensor([0.5])
a, b, x = (torch.randn(M, N).mul(3).to(torch.bfloat16) for _ in range(3))
w = (torch.rand(N) + 0.5).to(torch.bfloat16)

def pair():
    return torch.empty(M, N, dtype=f8), torch.empty(N, M, dtype=f8)

y1, stats = torch.empty(M, N, dtype=f8), torch.zeros(2)
on, off = torch.ones(1), torch.zeros(1)
TILES = ((M + B - 1) // B, (N + B - 1) // B)


def part():
    return torch.full((TILES[0] * TILES[1], 2), -1.0)


p._swiglu_fp8_kernel[((M * N + 255) // 256,)](a, b, y1, scale, stats, on, M * N, FMT_MAX=fmax, STORE=True,
                                              AMAX=True, BLOCK=256, GATED=False)
for grid in (1, 3):  # blocks strided over fewer programs than blocks: the same bytes and amax
    y2, stats2 = torch.empty(M, N, dtype=f8), torch.zeros(2)
    p._swiglu_fp8_kernel[(grid,)](a, b, y2, scale, stats2, on, M * N, FMT_MAX=fmax, STORE=True, AMAX=True,
                                  BLOCK=256, GATED=grid == 3)
    assert torch.equal(y2.view(torch.uint8), y1.view(torch.uint8)) and torch.equal(stats2, stats), "swiglu: grid"
h = torch.nn.functional.silu(a) * b
assert stats[1] == 0 and torch.allclose(stats[0], h.abs().amax().float(), rtol=1e-2), "swiglu: the amax"
stats2 = torch.zeros(2)
p._swiglu_fp8_kernel[(3,)](a, b, y1, scale, stats2, off, M * N, FMT_MAX=fmax, STORE=False, AMAX=True, BLOCK=256,
                           GATED=True)
assert torch.equal(stats2, torch.zeros(2)), "swiglu: gated off, nothing measured"
an = a.clone()
an[3, 5] = float("nan")
p._swiglu_fp8_kernel[(3,)](an, b, y1, scale, stats2, on, M * N, FMT_MAX=fmax, STORE=False, AMAX=True, BLOCK=256,
                           GATED=False)
assert stats2[1] == 1 and stats2[0] == stats[0], "swiglu: a NaN is flagged, not taken for the amax"
y1 = torch.empty(M, N, dtype=f8)
p._swiglu_fp8_kernel[(3,)](a, b, y1, scale, stats2, on, M * N, FMT_MAX=fmax, STORE=True, AMAX=False, BLOCK=256,
                           GATED=False)
for amax in (False, True):
    y, yt = pair()
    parts = part()
    p._swiglu_fp8_t_kernel[TILES](a, b, y, yt, scale, parts, M, N, FMT_MAX=fmax, AMAX=amax, BM=B, BN=B)
    assert torch.equal(y.view(torch.uint8), y1.view(torch.uint8)), "swiglu: the tiles' bytes"
    assert torch.equal(yt.view(torch.uint8), y.t().contiguous().view(torch.uint8)), "swiglu: the transpose"
    assert torch.equal(parts.amax(0), stats) if amax else (parts == -1).all(), "swiglu: the tiles' amax"

for out_w in (False, True):
    ww = w if out_w else w.float()
    norm = dict(FMT_MAX=fmax, OUT_W_DTYPE=out_w, BLOCK=128)
    y1, rstd, stats = torch.empty(M, N, dtype=f8), torch.empty(M, 1), torch.zeros(2)
    p._rmsnorm_fp8_kernel[(M,)](x, ww, y1, rstd, scale, stats, M, N, 1e-5, STORE=True, AMAX=True,
                                RSTD_GIVEN=False, **norm)
    rstd2, stats2 = torch.empty(M, 1), torch.zeros(2)  # the amax pass, rows strided over 4 programs
    p._rmsnorm_fp8_kernel[(4,)](x, ww, y1, rstd2, scale, stats2, M, N, 1e-5, STORE=False, AMAX=True,
                                RSTD_GIVEN=False, **norm)
    assert torch.equal(rstd, rstd2) and torch.equal(stats, stats2), "norm: the amax pass's rstd and amax"
    y2 = torch.empty(M, N, dtype=f8)
    p._rmsnorm_fp8_kernel[(4,)](x, ww, y2, rstd2, scale, stats2, M, N, 1e-5, STORE=True, AMAX=False,
                                RSTD_GIVEN=False, **norm)
    assert torch.equal(y2.view(torch.uint8), y1.view(torch.uint8)), "norm: rows strided over the grid"
    y3, rstd3 = torch.empty(M, N, dtype=f8), rstd2.clone()  # the cast given the amax pass's rstd
    p._rmsnorm_fp8_kernel[(3,)](x, ww, y3, rstd3, scale, stats2, M, N, 1e-5, STORE=True, AMAX=False,
                                RSTD_GIVEN=True, **norm)
    assert torch.equal(y3.view(torch.uint8), y1.view(torch.uint8)) and torch.equal(rstd3, rstd2), "norm: rstd given"
    ref = ww.float() * (x.float() * rstd).to(x.dtype).float()
    assert torch.allclose(stats[0], ref.abs().amax(), rtol=1e-2) and stats[1] == 0, "norm: the amax"
    y, yt = pair()
    p._rmsnorm_fp8_t_kernel[TILES](x, ww, rstd, y, yt, scale, part(), M, N, FMT_MAX=fmax, OUT_W_DTYPE=out_w,
                                   AMAX=False, BM=B, BN=B)
    assert torch.equal(y.view(torch.uint8), y1.view(torch.uint8)), "norm: the tiles' bytes"
    assert torch.equal(yt.view(torch.uint8), y.t().contiguous().view(torch.uint8)), "norm: the transpose"

xs = torch.randn(10_000).mul(7).to(torch.bfloat16)  # kernels.amax's pass: 40 blocks, the last one partial
for grid in (1, 3, 40):
    stats = torch.zeros(2)
    p.kernels._amax_kernel[(grid,)](xs, stats, xs.numel(), BLOCK=256)
    assert stats[0] == xs.abs().amax().float() and stats[1] == 0, "amax: blocks strided over the grid"
xs[9_999] = float("nan")
stats = torch.zeros(2)
p.kernels._amax_kernel[(3,)](xs, stats, xs.numel(), BLOCK=256)
assert stats[1] == 1 and stats[0] <= xs[:9_999].abs().amax().float(), "amax: a NaN flagged"
print("ok")
"""


@pytest.mark.skipif(kernels.triton is None, reason="needs Triton")
def test_transposing_producer_kernels_write_the_row_kernels_bytes_under_the_interpreter(tmp_path):
    """The transposing casts (tiles, partial at the edges) write the bytes of the producers' one-pass kernels and
    their exact transpose, and with AMAX their tiles' amaxes, whose max is the row kernels'; the norm's amax pass
    stores the rstd its cast pass uses; gated off, SwiGLU's amax pass measures nothing; the row kernels' grid-stride
    loops (fewer programs than blocks or rows) give the same bytes, rstd and amax, a NaN flagged apart, and so does
    kernels.amax's pass (its NaN flagged). Under
    Triton's CPU interpreter (E5M2: its E4M3 rounding is unfaithful, the same in both kernels); a GPU test compares
    both with torch."""
    import os
    import subprocess
    import sys

    script = tmp_path / "check.py"  # a file: triton.jit reads its functions' source
    script.write_text(TRANSPOSING_CHECK)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
