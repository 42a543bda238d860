"""GPU-only checks (skipped without CUDA): the bf16 path, flash/efficient attention, fused AdamW, compile."""

import math

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


@pytest.mark.parametrize("out", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_fp8_tensor_cores_match_emulation(gran, out):
    from lowbit.numerics.gemm import fast_path_reason, scaled_matmul
    from lowbit.numerics.qtensor import quantize
    from lowbit.numerics.scaling import Scaling

    torch.manual_seed(0)
    a = quantize(torch.randn(256, 512, device="cuda") * 3, Scaling("e4m3", gran))
    b = quantize(torch.randn(384, 512, device="cuda") * 0.02, Scaling("e4m3", gran))
    assert fast_path_reason(a, b, out) is None  # rowwise fp32: the bf16 kernel, converted
    fast = scaled_matmul(a, b, out)
    assert fast.dtype == out
    fast = fast.float()
    ref = a.dequantize() @ b.dequantize().t()
    torch.testing.assert_close(fast, ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def test_every_recipe_runs_compiled_on_gpu():
    from lowbit.numerics.recipes import RECIPES, convert

    for name, recipe in RECIPES.items():
        torch.manual_seed(0)
        args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512, max_seq_len=128)
        model = Llama(args).cuda()
        convert(model, recipe)
        x = torch.randint(0, 512, (4, 128), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.compile(model)(x, x)
        loss.backward()
        assert torch.isfinite(loss), name
        torch._dynamo.reset()


def test_compiled_training_with_telemetry(tmp_path, capsys):
    from conftest import SMALL, cli, read_metrics

    code, out, err = cli(capsys, "train", *SMALL, "--recipe", "fp8-tensorwise", "--train.compile", "true",
                         "--train.steps", "4", "--numerics.telemetry_every", "2", "--run.dir", tmp_path / "run")
    assert code == 0, err
    assert len([r for r in read_metrics(tmp_path / "run") if "numerics" in r]) == 3  # steps 1, 2, 4


@pytest.mark.parametrize("weights,master", [("bf16", "none"), ("bf16", "fp16"), ("bf16", "fp32"), ("fp16", "none")])
def test_compiled_optimizer_update_matches_eager_on_gpu(weights, master):
    from lowbit.optim import LowbitAdamW, StatePrecision

    prec = StatePrecision(weights=weights, master=master, grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")
    torch.manual_seed(0)
    init = [torch.randn(256, 128, device="cuda") * 0.02, torch.randn(128, 256, device="cuda") * 0.02]
    runs = {}
    for compiled in (False, True):
        params = [torch.nn.Parameter(t.clone()) for t in init]
        opt = LowbitAdamW(params, lr=1e-3, precision=prec, compile=compiled)
        g = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(5):
            sum((p.float() * torch.randn(p.shape, device="cuda", generator=g)).sum() for p in params).backward()
            opt.step()
            opt.zero_grad()
        runs[compiled] = [p.value() if weights == "fp16" else p.float() for p in params]
    for a, b in zip(runs[False], runs[True]):
        assert (a - b).abs().max().item() <= 2 ** -7 * a.abs().max().item()  # at most a bf16 rounding apart


def test_fp16_weights_train_compiled_by_block_as_eagerly_on_gpu():
    """fp8lm-o2 with FP16 weights (ScaledFP16Weight) compiled per block: no graph break, the losses of eager."""
    from torch._dynamo.utils import counters

    from lowbit.numerics import convert, get_recipe
    from lowbit.optim import LowbitAdamW, StatePrecision
    from lowbit.train.compile import compile_model

    prec = StatePrecision(weights="fp16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512, max_seq_len=128)
    x = torch.randint(0, 512, (4, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = Llama(args).cuda()
        convert(model, get_recipe("fp8lm-o2"))
        covered = [m.weight for n, m in model.named_modules() if type(m).__name__ == "LowPrecisionLinear"]
        opt = LowbitAdamW([{"params": covered, "precision": prec}], lr=1e-3)
        fwd = compile_model(model, "blocks") if compiled else model
        counters.clear()
        losses[compiled] = []
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[compiled].append(loss.item())
        if compiled:
            assert not counters["graph_break"], dict(counters["graph_break"])
        torch._dynamo.reset()
    assert losses[True][0] == pytest.approx(losses[False][0], rel=1e-3), losses  # later steps: FP8 casts flip
    assert losses[True] == pytest.approx(losses[False], rel=1e-2), losses


@pytest.mark.parametrize("weights", ["bf16", "fp16"])
def test_fp8lm_o2_trains_compiled_on_gpu(tmp_path, capsys, weights):
    import json

    from conftest import SMALL, cli

    code, out, err = cli(capsys, "train", *SMALL, "--recipe", "fp8lm-o2", "--train.steps", "6",
                         "--train.micro_batch_size", "2", "--optim.weights", weights, "--train.compile", "true",
                         "--run.dir", tmp_path / "run")
    assert code == 0, err
    report = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert report["covered"]["bytes_per_param"]["total"] == 6.0


def test_performer_on_gpu_matches_cpu_and_trains_compiled():
    from lowbit.models.performer import favor_attention, orthogonal_features

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 1000, 64) * 0.5 for _ in range(3))
    w = orthogonal_features(266, 64)
    ref = favor_attention(q.double(), k.double(), v.double(), w.double(), chunk=128)
    gpu = favor_attention(*(t.cuda() for t in (q, k, v)), w.cuda(), chunk=128).cpu()
    assert (gpu.double() - ref).abs().max() < 1e-4
    low = favor_attention(*(t.cuda().bfloat16() for t in (q, k, v)), w.cuda(), chunk=128).cpu()
    assert ((low.double() - ref).norm() / ref.norm()) < 2e-2
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512, max_seq_len=512,
                     attention="performer")
    model = Llama(args).cuda()
    x = torch.randint(0, 512, (2, 512), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.compile(model)(x, x)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("master,bound", [("none", 1.2), ("fp16", 0.5), ("fp32", 0.25)])
def test_compiled_update_with_a_master_tracks_fp64_at_a_small_lr(master, bound):
    """Late in a schedule (lr 3e-5) most updates are below half a bf16 ulp of the weights: only a master keeps
    them. On CPU (eager) the fp32 master tracks fp64 to 0.17 and no master to 0.90; the compiled GPU update must
    do the same."""
    import math

    from test_optim import _fp64_adamw, _grads, _params

    from lowbit.optim import LowbitAdamW, StatePrecision

    lr = 3e-5
    prec = StatePrecision(weights="bf16", master=master, grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    start = [p.detach().double().cpu() for p in params]
    opt = LowbitAdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, precision=prec, compile=True)
    for step in range(60):
        grads = _grads(step, [p.shape for p in params])
        sum((p.float() * g.cuda()).sum() for p, g in zip(params, grads)).backward()
        opt.step()
        opt.zero_grad()
    ref = _fp64_adamw(_params(), 60, lr=lr)
    err = math.sqrt(sum(((p.double().cpu() - r) ** 2).sum().item() for p, r in zip(params, ref)))
    moved = math.sqrt(sum(((r - s) ** 2).sum().item() for r, s in zip(ref, start)))
    assert err / moved <= bound, err / moved


def test_step_profile_sorts_real_kernel_names():
    """`bench step --profile` on real CUDA kernels: an FP8 step's GEMMs, attention and fused kernels land in their
    kinds, no annotation range is counted, and the busy time fits inside the sum."""
    from lowbit.numerics.recipes import convert, get_recipe
    from lowbit.tools.bench.profile import kernel_ms

    torch.manual_seed(0)
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512, max_seq_len=256)
    model = Llama(args).cuda()
    convert(model, get_recipe("fp8-tensorwise"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 512, (4, 256), device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x)
        loss.backward()
        opt.step()  # torch.optim records an "Optimizer.step#..." range on the GPU timeline
        opt.zero_grad(set_to_none=True)

    step()
    got = kernel_ms(step, torch.device("cuda"))
    assert got["gemm_ms"] > 0 and got["attention_ms"] > 0 and got["kernels"] > 0, got
    assert not any(k["kernel"].startswith("Optimizer.") for k in got["top"]), got["top"]
    from lowbit.tools.bench.profile import KIND_NAMES

    assert got["quant_ms"] + got["fused_quant_ms"] > 0, got  # eager: lowbit's amax/cast kernels
    names = {k["kernel"]: k["kind"] for k in got["top"]}
    assert names.get("_cast_kernel") == "quant", names  # the linears' casts, by the Triton kernel's name
    total = sum(got[f"{k}_ms"] for k in KIND_NAMES)
    assert 0 < got["busy_ms"] <= total * 1.001


def test_occ_split_on_gpu_compiled_equals_cpu():
    """The outlier selection on CUDA (topk quantile, traced and compiled by inductor) picks what the CPU's
    (kthvalue, eager) does, with and without overflow, and launches no host sync."""
    from lowbit.numerics.fp4 import OCC, occ_split

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, 512, generator=g) / torch.rand(4096, 512, generator=g).clamp(min=0.05)).bfloat16()
    spiky = x.clone()
    spiky[1::2][torch.rand(2048, 512, generator=g) < 0.1] *= 100  # overflow: outliers where the sample is not
    split = torch.compile(lambda t: occ_split(t, OCC(0.99)), fullgraph=True)
    for t in (x, spiky):
        ref = occ_split(t, OCC(0.99))
        tc = t.cuda()
        split(tc)  # compile first: compiling may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = split(tc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for a, b in zip(ref, got):
            assert torch.equal(a, b.cpu())


def test_sampled_quantile_on_gpu_equals_cpu_with_a_nan():
    """CUDA's topk-based quantile counts NaN as the largest value, as the CPU's kthvalue does."""
    from lowbit.numerics.fp4 import abs_quantile

    x = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    x[0, 3] = float("nan")
    for method in ("sample", "exact"):
        assert torch.equal(abs_quantile(x.cuda(), 0.99, method).cpu(), abs_quantile(x, 0.99, method))


def _optimizer_steps(graphs: bool, rounding: str):
    """Nine steps of a two-group optimizer (bf16 weights with E4M3 gradients; fp32 weights and gradients with FP8
    moments), the learning rate changing every step, one parameter without a gradient at step 4 and the states
    rolled back to step 2's at step 6. Returns the weights', states' and norms' bits, and the optimizer."""
    import copy

    from lowbit.optim import LowbitAdamW, StatePrecision

    low = StatePrecision(weights="bf16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16", rounding=rounding)
    plain = StatePrecision(exp_avg="e4m3", exp_avg_sq="e5m2", rounding=rounding)
    torch.manual_seed(0)
    shapes = [(64 + 8 * i, 32) for i in range(11)] + [(32,)]  # a full chunk and a short one; a 1-d tensor: no decay
    a = [torch.nn.Parameter((torch.randn(s, device="cuda") * 0.02).bfloat16()) for s in shapes]
    b = [torch.nn.Parameter(torch.randn(48, 16, device="cuda") * 0.02) for _ in range(3)]
    torch.manual_seed(1)
    opt = LowbitAdamW([{"params": a, "precision": low}, {"params": b, "precision": plain}], lr=1e-3,
                      cuda_graphs=graphs)
    g = torch.Generator(device="cuda").manual_seed(2)
    norms, saved = [], None
    for step in range(9):
        for group in opt.param_groups:
            group["lr"] = 1e-3 * (step + 1)
        used = [p for i, p in enumerate(a + b) if not (step == 4 and i == 3)]
        sum((p.float() * torch.randn(p.shape, device="cuda", generator=g)).sum() for p in used).backward()
        norms.append(opt.clip_grad_norm_(0.5))
        opt.step()
        opt.zero_grad()
        if step == 2:
            saved = copy.deepcopy(opt.state_dict())
        if step == 6:
            opt.load_state_dict(saved)

    def bits(t):
        return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])

    states = [bits(opt.state[p][k]) for p in a + b for k in ("exp_avg", "exp_avg_sq")]
    return [bits(p) for p in a + b] + states + [bits(torch.stack(norms))], opt


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_optimizer_cuda_graphs_replay_the_eager_steps_bit_for_bit(rounding):
    """The update and the stored norms run eagerly, then are captured, then replayed (a new key runs eagerly
    again): every step equals the eager optimizer's, and stochastic rounding draws fresh noise each replay."""
    eager, _ = _optimizer_steps(False, rounding)
    graphed, opt = _optimizer_steps(True, rounding)
    assert {k[0] for k in opt._graphed} == {"update", "norms"}
    assert all(1 <= v.captures <= v.limit and v.graph is not None for v in opt._graphed.values())
    for x, y in zip(eager, graphed):
        assert torch.equal(x, y)


def test_sdpa_backends_on_gpu_agree_and_run_the_kernel_named():
    from lowbit.models.llama import CausalSDPA

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    outs = {}
    for backend in ("auto", "flash", "cudnn"):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = CausalSDPA(backend)(q, k, v)
            out.float().square().sum().backward()
            torch.cuda.synchronize()
        kernels = " ".join(e.name.lower() for e in prof.events())
        outs[backend] = (out.detach().float(), *(t.grad.float() for t in (q, k, v)))
        q.grad = k.grad = v.grad = None
        if backend == "cudnn":
            assert "cudnn" in kernels, kernels[:400]
        if backend == "flash":
            assert "cudnn" not in kernels and "flash" in kernels, kernels[:400]
    for a, b in zip(outs["cudnn"], outs["flash"]):  # output and the three gradients, to bf16's precision
        assert (a - b).norm() <= 1e-2 * b.norm()
    compiled = torch.compile(CausalSDPA("cudnn"), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v).float(), outs["cudnn"][0], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-rowwise", "fp8-delayed", "fp4-no-occ"])
def test_compiled_linears_keeping_their_inputs_match_eager_on_gpu(recipe):
    """Compiled, a linear keeps its input and casts it again in backward (eager keeps the FP8 copy). Compiled
    and eager FP8 gradients differ by about as much as FP8 and bf16 do (E5M2 gradients round anew on any small
    change; 7-12% at this random init on the CPU, as before the change): each must be as close to bf16's as the
    eager one is. A wrong scale or layout in backward would be off by far more."""
    from lowbit.numerics.recipes import convert, get_recipe

    def grads(recipe, compiled):
        torch.manual_seed(0)
        args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512,
                         max_seq_len=128)
        model = Llama(args).cuda()
        convert(model, get_recipe(recipe))
        x = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            (torch.compile(model) if compiled else model)(x, x).backward()
        torch._dynamo.reset()
        return {n: p.grad.float() for n, p in model.named_parameters()}

    ref, eager, compiled = grads("bf16", False), grads(recipe, False), grads(recipe, True)
    for n, g in ref.items():
        err_eager, err_compiled = ((t[n] - g).norm() / g.norm() for t in (eager, compiled))
        assert err_compiled <= 2 * err_eager + 0.02, (n, err_compiled.item(), err_eager.item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", ["plain", "inf", "nan", "zeros", "tiny", "odd size"])
def test_triton_quantization_is_the_torch_formula_bit_for_bit(case, fmt, dtype, monkeypatch):
    """The eager GPU path's Triton kernels (amax, cast, fused quantize) against the torch formulas run on the
    CPU (on the GPU those formulas now call the kernels)."""
    import math

    from lowbit.numerics import kernels
    from lowbit.numerics.qtensor import QTensor, cast, quantize
    from lowbit.numerics.scaling import Scaling, group_amax, scale_from_amax

    if kernels.triton is None:
        pytest.skip("no Triton")
    torch.manual_seed(0)
    s = Scaling(fmt)
    x = torch.randn(1000, 4097 if case == "odd size" else 4096) * 3
    x[5, 7] = math.inf if case == "inf" else x[5, 7]
    x[9, 1] = math.nan if case == "nan" else x[9, 1]
    x = x.zero_() if case == "zeros" else x * 1e-42 if case == "tiny" else x
    x = x.to(dtype)
    amax = group_amax(x, s)  # the CPU formula
    scale, _ = scale_from_amax(amax, s)
    ref = QTensor(cast(x, scale, s), scale.reciprocal(), s)
    xg = x.cuda()
    assert kernels.usable(xg)
    torch.testing.assert_close(group_amax(xg, s).cpu(), amax, rtol=0, atol=0, equal_nan=True)

    def same(a, b):  # the same bytes, NaNs aside (their bit patterns may differ)
        a, nan = a.cpu(), b.float().isnan()
        return torch.equal(a.float().isnan(), nan) and torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])

    assert same(cast(xg, scale.cuda(), s), ref.data)
    for reverse in (True, False):  # the fused kernels, the cast walking the tensor from either end
        monkeypatch.setattr(kernels, "REVERSE", reverse)
        q = quantize(xg, s)
        assert same(q.data, ref.data) and torch.equal(q.scale_inv.cpu(), ref.scale_inv)
    monkeypatch.setattr(kernels, "ENABLED", False)  # LOWBIT_TRITON=0
    assert not kernels.usable(xg)


@pytest.mark.parametrize("weights,master,grads,m,v", [
    ("fp16", "none", "e4m3", "e4m3", "fp16"),  # fp8lm-o2
    ("bf16", "none", "e4m3", "e4m3", "fp16"),  # fp8lm-o2 with bf16 weights
    ("bf16", "fp16", "e4m3", "e4m3", "fp16"),  # fp8lm-o3
    ("fp32", "none", "e4m3", "e4m3", "fp16"),  # fp4's optimizer
    ("fp32", "none", "e5m2", "bf16", "e5m2"),
    ("bf16", "fp32", "bf16", "fp32", "e4m3"),
])
@pytest.mark.parametrize("scales", ["amax", "bound", "mixed"])
@pytest.mark.parametrize("fast", [False, True])
def test_triton_update_writes_what_the_compiled_update_writes(weights, master, grads, m, v, scales, fast,
                                                              monkeypatch):
    """The Triton update (optim/update_kernel.py) against the compiled torch passes, one step from the same
    states: the same scales, and every stored value the same or its neighbour in its format (the two differ only
    in how fp32 products are rounded and fused, and with `fast` in the weight step's approximate sqrt and
    division), or apart by less than an fp32 rounding of the terms."""
    from lowbit.optim import LowbitAdamW, StatePrecision, update_kernel

    monkeypatch.setattr(update_kernel, "FAST", fast)

    prec = StatePrecision(weights=weights, master=master, grads=grads, exp_avg=m, exp_avg_sq=v, scales=scales)
    calls = []
    real = update_kernel.update
    monkeypatch.setattr(update_kernel, "update", lambda *a: calls.append(1) or real(*a))

    def stepped(triton_on: bool):
        monkeypatch.setattr(update_kernel, "ENABLED", triton_on)
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in ((1024, 512), (512, 1024))]
        opt = LowbitAdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, precision=prec, compile=True,
                          cuda_graphs=False)
        g = torch.Generator(device="cuda").manual_seed(1)
        for step in range(3):  # the last step alone on the path under test
            monkeypatch.setattr(update_kernel, "ENABLED", triton_on and step == 2)
            sum((p.float() * torch.randn(p.shape, device="cuda", generator=g)).sum() for p in params).backward()
            opt.step()
            opt.zero_grad()
        out = {}
        for i, p in enumerate(params):
            st = opt.state[p]
            out[f"{i}.weights"] = p._data if weights == "fp16" else p.detach()
            out |= {f"{i}.{k}": st[k] for k in ("exp_avg", "exp_avg_sq", "master") if k in st}
            out |= {f"{i}.{k}": st[k].clone() for k in ("exp_avg_scale", "exp_avg_sq_scale", "master_scale", "step")
                    if k in st}
            out |= {f"{i}.weight_scale": p._scale.clone()} if weights == "fp16" else {}
            out |= {f"{i}.amax_record": opt._amax[p].clone()} if scales != "amax" else {}
        return out

    compiled = stepped(False)
    assert not calls
    fused = stepped(True)
    assert calls
    for name, a in compiled.items():
        b = fused[name]
        if a.dim() == 0:
            assert torch.equal(a, b), (name, a, b)
            continue
        if name.endswith("amax_record"):  # amaxes of stored values, which may be a neighbour apart (E4M3: 1/8)
            assert torch.allclose(a, b, rtol=0.13, atol=0), (name, a, b)
            continue
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
        apart = (a.view(ints).int() - b.view(ints).int()).abs()
        # a result near 0 from w * (1 - lr * wd) - update (cancellation) may differ by several of its own ulps
        # where one side fused the multiply-add: excused if the difference is below 2^-20 of the tensor's amax
        # (an fp32 rounding of the terms); -0 and +0 are the same state
        tiny = (a.float() - b.float()).abs() <= 2.0 ** -20 * a.float().abs().max()
        apart = torch.where(tiny, 0, apart)
        worst = apart.flatten().argmax()
        assert apart.max().item() <= 1 and (apart > 0).float().mean().item() < 0.02, \
            (name, a.dtype, apart.max().item(), (apart > 1).sum().item(), apart.float().mean().item(),
             a.flatten()[worst].item(), b.flatten()[worst].item())


@pytest.mark.parametrize("cp,layout", [(2, "zigzag"), (4, "zigzag"), (2, "plain")])
def test_ring_schedule_on_flash_matches_sdpa_on_gpu(cp, layout):
    """The ring's blocks through the CUDA flash kernel (bf16) against one SDPA flash call: forward and gradients
    within bf16 rounding, and the flash path (not the math fallback) is the one taken."""
    import torch.nn.functional as F

    from lowbit.distributed.attention_block import kernel
    from lowbit.distributed.context_parallel import shard_positions
    from lowbit.distributed.ring_blocks import OneDeviceRing

    L = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, 8, L, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    assert kernel(q) == "flash-cuda"
    pos = torch.stack([shard_positions(L, cp, r, layout) for r in range(cp)])
    res = []
    for attend in (lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True),
                   lambda a, b, c: OneDeviceRing.apply(a, b, c, pos, True)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves)
        out.backward(dout)
        res.append([out.detach().float()] + [t.grad.float() for t in leaves])
    for got, ref in zip(*reversed(res)):  # two bf16 computations apart: a missing or doubled block is O(1) off
        assert (got - ref).abs().max().item() <= 5e-2 * ref.abs().max().item()


def test_fp8_kv_wire_on_gpu_equals_the_cpu_cast():
    """parallel.cp_kv_dtype fp8 on CUDA bf16 K/V: the bytes, scales and dequantized block equal the CPU's."""
    from lowbit.distributed.kv_wire import KVWire

    wire = KVWire("fp8")
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    gpu, cpu = wire.pack(k), wire.pack(k.cpu())
    assert gpu[0].dtype == torch.uint8 and gpu[0].is_cuda
    for a, b in zip(gpu, cpu):
        assert torch.equal(a.cpu(), b)
    back = wire.unpack(gpu, k)
    assert back.dtype == torch.bfloat16 and torch.equal(back.cpu(), wire.unpack(cpu, k.cpu()))


def test_ring_schedule_keeps_no_seq_by_seq_tensor_on_gpu():
    from lowbit.distributed.context_parallel import OneDeviceRingCore

    seq = 8192
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=512, max_seq_len=seq)
    model = Llama(args).cuda()
    for m in model.modules():
        if hasattr(m, "wq"):
            m.core = OneDeviceRingCore(2, seq)
    x = torch.randint(0, 512, (1, seq), device="cuda")
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x)
    loss.backward()
    assert not [s for s in shapes if sum(d >= seq // 2 for d in s) >= 2]


@pytest.mark.parametrize("backend", ["auto", "flash", "efficient", "math"])
@pytest.mark.parametrize("policy", ["none", "full", "selective"])
def test_dropout_on_gpu_recomputes_its_masks_and_leaves_eval_alone(backend, policy):
    """SDPA's dropout kernels and the residual dropout under activation checkpointing: eagerly the same seed gives
    the same loss and gradients with and without recomputation; compiled it trains; eval mode drops nothing."""
    base = dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=512, max_seq_len=256,
                sdpa_backend=backend)
    torch.manual_seed(0)
    ref = Llama(ModelArgs(**base, dropout=0.1)).cuda()
    model = Llama(ModelArgs(**base, dropout=0.1, checkpointing=policy)).cuda()
    model.load_state_dict(ref.state_dict())
    plain = Llama(ModelArgs(**base)).cuda()
    plain.load_state_dict(ref.state_dict())
    x = torch.randint(0, 512, (2, 256), device="cuda")
    for compiled in (False, True):
        runs = []
        for m in (ref, model):
            f = torch.compile(m) if compiled else m
            torch.manual_seed(1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(x, x)
            loss.backward()
            runs.append((loss.item(), [p.grad.clone() for p in m.parameters()]))
            m.zero_grad()
        if compiled:  # inductor draws its own random streams per graph: the two graphs need not agree
            assert all(math.isfinite(r[0]) for r in runs)
        else:
            assert runs[0][0] == runs[1][0], (runs[0][0], runs[1][0])
            for a, b in zip(runs[0][1], runs[1][1]):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-3)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            assert torch.equal(model.eval()(x), plain.eval()(x))
        model.train()
        torch._dynamo.reset()


def _same_bytes(a, b):
    """The same FP8 bytes, NaNs aside (their bit patterns may differ)."""
    a, b = a.cpu(), b.cpu()
    nan = b.float().isnan()
    return torch.equal(a.float().isnan(), nan) and torch.equal(a.view(torch.uint8)[~nan], b.view(torch.uint8)[~nan])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", ["plain", "inf", "nan", "saturating", "odd size", "256x768", "512x256", "768x256"])
def test_triton_cast_transpose_is_the_torch_formula_bit_for_bit(case, fmt, dtype):
    """lowbit::cast_transpose on the GPU: y and yᵀ the bytes of the torch cast formula (its CPU kernel), the amax
    group_amax's; and (bf16, plain) torch.compile keeps the op as one call. The "AxB" cases are a small LLaMA's
    weight and activation shapes, whose transposed copies of fp32 tensors held NaN bytes on an H100, in counts that
    varied from run to run (kernels.FUSED_TRANSPOSE): each is cast 20 times."""
    import math

    from lowbit.numerics import kernels
    from lowbit.numerics.scaling import Scaling, group_amax

    if kernels.triton is None:
        pytest.skip("no Triton")
    torch.manual_seed(0)
    model = case[0].isdigit()  # a model's shape and scale: weights ~ N(0, 0.02) cast to E4M3's range
    x = torch.randn(tuple(map(int, case.split("x"))) if model else (1000, 4097 if case == "odd size" else 4096))
    x = x * (0.02 if model else 3)
    x[5, 7] = math.inf if case == "inf" else x[5, 7]
    x[9, 1] = math.nan if case == "nan" else x[9, 1]
    x = (x * 1e3 if case == "saturating" else x).to(dtype)
    scale = torch.tensor(448.0 / 9.0 if fmt == "e4m3" else 57344.0 / 9.0) * (80 if model else 1)
    e5m2 = fmt == "e5m2"
    y, yt, amax = torch.ops.lowbit.cast_transpose(x, scale, e5m2, True)  # the CPU kernel: the torch formulas
    assert torch.equal(yt.float().nan_to_num(7), y.t().float().nan_to_num(7))
    xg = x.cuda()
    assert kernels.usable(xg)
    for with_amax in (True, False) * (10 if model else 1):  # repeated: the bad bytes' count varied run to run
        yg, ytg, amax_g = torch.ops.lowbit.cast_transpose(xg, scale.cuda(), e5m2, with_amax)
        assert _same_bytes(yg, y) and _same_bytes(ytg, yt) and ytg.is_contiguous()
        want = group_amax(x, Scaling(fmt)) if with_amax else torch.zeros(())
        torch.testing.assert_close(amax_g.cpu(), want, rtol=0, atol=0, equal_nan=True)
    if case == "plain" and dtype == torch.bfloat16:  # compiled once per format (compiles take seconds)
        compiled = torch.compile(lambda t, s: torch.ops.lowbit.cast_transpose(t, s * 1.0, e5m2, False),
                                 fullgraph=True)
        yc, ytc, _ = compiled(xg, scale.cuda())
        assert _same_bytes(yc, y) and _same_bytes(ytc, yt)
        torch._dynamo.reset()


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
def test_fused_cast_transpose_linear_matches_the_unfused_path_bit_for_bit(recipe, monkeypatch):
    """Eager on a GPU (kernels.FUSED_TRANSPOSE on, as here) a tensorwise FP8 linear casts x, W and dy with their
    transposes in one pass each and keeps the transposed copies: y, dx and dW are the bits of the path that
    transposes the FP8 bytes in backward."""
    import lowbit.numerics.linear as linear_mod
    import lowbit.numerics.qtensor as qtensor_mod
    from lowbit.numerics import kernels
    from lowbit.numerics.recipes import convert, get_recipe

    if kernels.triton is None:
        pytest.skip("no Triton")
    calls = []
    real_op = torch.ops.lowbit.cast_transpose
    monkeypatch.setattr(kernels, "FUSED_TRANSPOSE", True)  # off by default: this test is the kernel's

    def run(fused):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(512, 768, bias=False), torch.nn.Linear(768, 256, bias=False))
        convert(m, get_recipe(recipe))
        m.cuda()
        x = torch.randn(4, 300, 512, device="cuda", requires_grad=True)
        monkeypatch.setattr(linear_mod, "transpose_fused", qtensor_mod.transpose_fused if fused else
                            (lambda t, s: False))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = m(x)
        y.float().pow(2).mean().backward()
        return y.detach(), x.grad, [p.grad for p in m.parameters()]

    monkeypatch.setattr(torch.ops.lowbit, "cast_transpose", lambda *a: calls.append(a[0].shape) or real_op(*a),
                        raising=False)
    y0, dx0, dw0 = run(False)
    assert not calls
    y1, dx1, dw1 = run(True)
    assert len(calls) == 6, calls  # x, W and dy of each of the two layers
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and all(torch.equal(a, b) for a, b in zip(dw0, dw1))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", ["plain", "nan", "odd size"])
def test_triton_swiglu_fp8_is_the_unfused_path_bit_for_bit(case, fmt):
    """The fused SwiGLU (silu(a)·b written as FP8) against the model's formula on the GPU and lowbit's quantize:
    the bytes, the scale and the amax, by current scaling (two passes) and with a given scale (one)."""
    import math

    import torch.nn.functional as F

    from lowbit.numerics import kernels
    from lowbit.numerics.producers import swiglu_fp8
    from lowbit.numerics.qtensor import cast, quantize
    from lowbit.numerics.scaling import Scaling

    if kernels.triton is None:
        pytest.skip("no Triton")
    torch.manual_seed(0)
    cols = 1377 if case == "odd size" else 11008
    a, b = (torch.randn(512, cols, device="cuda").mul(4).to(torch.bfloat16) for _ in range(2))
    if case == "nan":
        a[3, 5] = math.nan
    s = Scaling(fmt)
    with torch.autocast("cuda", enabled=False):
        h = F.silu(a) * b
    want = quantize(h, s)
    q, amax = swiglu_fp8(a, b, s)
    assert _same_bytes(q.data, want.data) and torch.equal(q.scale_inv, want.scale_inv)
    torch.testing.assert_close(amax, h.abs().amax().float(), rtol=0, atol=0, equal_nan=True)
    scale = torch.tensor(7.0, device="cuda")
    q, amax = swiglu_fp8(a, b, s, scale)
    assert _same_bytes(q.data, cast(h, scale, s))
    torch.testing.assert_close(amax, h.abs().amax().float(), rtol=0, atol=0, equal_nan=True)
    for with_amax in (False, True):  # the transposing cast's tiles, and their amax (delayed scaling's one pass)
        y, yt, amax = torch.ops.lowbit.swiglu_cast_t(a, b, scale, fmt == "e5m2", with_amax)
        assert _same_bytes(y, cast(h, scale, s)) and _same_bytes(yt, cast(h, scale, s).t().contiguous())
        want = h.abs().amax().float() if with_amax else torch.zeros((), device="cuda")
        torch.testing.assert_close(amax, want, rtol=0, atol=0, equal_nan=True)
    for gate in (True, False):  # the gated amax pass: measured where on, 0 (nothing read) where off
        got = torch.ops.lowbit.swiglu_amax(a, b, torch.tensor(gate, device="cuda"))
        want = h.abs().amax().float() if gate else torch.zeros((), device="cuda")
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_triton_rmsnorm_fp8_is_the_unfused_path_bit_for_bit_given_its_rstd(fmt, wdtype):
    """The fused RMSNorm written as FP8: its rstd within a few ulps of torch's (a sum in another order), and the
    bytes those of the model's formula and lowbit's cast given that rstd; rows whose rstd is torch's are the
    unfused path's bytes outright."""
    from lowbit.numerics import kernels
    from lowbit.numerics.producers import rmsnorm_fp8
    from lowbit.numerics.qtensor import cast
    from lowbit.numerics.scaling import Scaling, scale_from_amax

    if kernels.triton is None:
        pytest.skip("no Triton")
    torch.manual_seed(0)
    s = Scaling(fmt)
    x = torch.randn(2048, 4096, device="cuda").mul(3).to(torch.bfloat16)
    w = (torch.rand(4096, device="cuda") + 0.5).to(wdtype)
    q, rstd, amax = rmsnorm_fp8(x, w, 1e-5, s)
    ref_rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-6, atol=0)
    h = w * (x.float() * rstd).to(x.dtype)  # the model's formula with the kernel's rstd
    assert torch.equal(amax, h.abs().amax().float())
    scale = scale_from_amax(amax, s)[0]
    assert torch.equal(q.scale_inv, scale.reciprocal()) and _same_bytes(q.data, cast(h, scale, s))
    same_rows = (rstd == ref_rstd).squeeze(1)
    h_torch = w * (x.float() * ref_rstd).to(x.dtype)
    assert _same_bytes(q.data[same_rows], cast(h_torch, scale, s)[same_rows])
    # the amax pass's rstd, and the transposing cast's tiles given it (an odd shape: partial tiles)
    amax2, rstd2 = torch.ops.lowbit.rmsnorm_amax(x, w, 1e-5)
    assert torch.equal(rstd2, rstd) and torch.equal(amax2, amax)
    # and an fp32 input of a model's shape (the residual stream's; kernels.FUSED_TRANSPOSE: the linears' transposing
    # cast wrote NaN bytes from fp32 tensors), cast 10 times
    for xo, wo, times in ((x[:1000, :1377].contiguous(), w[:1377].contiguous(), 1),
                          (x[:512, :256].float().contiguous(), w[:256].contiguous(), 10)):
        ro = torch.ops.lowbit.rmsnorm_amax(xo, wo, 1e-5)[1]
        want = cast(wo * (xo.float() * ro).to(xo.dtype), scale, s)
        for _ in range(times):
            y, yt = torch.ops.lowbit.rmsnorm_cast_t(xo, wo, ro, scale, fmt == "e5m2")
            assert _same_bytes(y, want) and _same_bytes(yt, want.t().contiguous())


def test_fused_swiglu_linear_is_the_unfused_mlp_tail_bit_for_bit_on_gpu():
    """numerics.fused_mlp on the GPU (the fused SwiGLU kernels, cast_transpose, _scaled_mm) against the model's
    SwiGLU and an eager fp8-tensorwise LowPrecisionLinear: y and the gradients of a, b and W bit for bit; compiled
    (the kernels kept as custom-op calls) it runs and stays close."""
    from lowbit.models.llama import SwiGLU
    from lowbit.numerics import kernels
    from lowbit.numerics.fused_mlp import swiglu_linear
    from lowbit.numerics.linear import LowPrecisionLinear
    from lowbit.numerics.recipes import get_recipe

    if kernels.triton is None:
        pytest.skip("no Triton")
    recipe = get_recipe("fp8-tensorwise").linear
    torch.manual_seed(0)
    w2 = LowPrecisionLinear.from_linear(torch.nn.Linear(1408, 512, bias=False), recipe).cuda().to(torch.bfloat16)
    a0, b0 = (torch.randn(4, 512, 1408, device="cuda").mul(2).to(torch.bfloat16) for _ in range(2))
    dy = torch.randn(4, 512, 512, device="cuda").to(torch.bfloat16)
    out = []
    for how in ("unfused", "fused", "compiled"):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        w2.weight.grad = None
        if how == "unfused":
            y = w2(SwiGLU()(a, b))
        else:
            fn = torch.compile(swiglu_linear) if how == "compiled" else swiglu_linear
            y = fn(a, b, w2.weight, recipe)
        y.backward(dy)
        out.append([y.detach(), a.grad, b.grad, w2.weight.grad])
    torch._dynamo.reset()
    assert all(torch.equal(u, f) for u, f in zip(out[0], out[1]))
    for u, c in zip(out[0], out[2]):
        assert (u.float() - c.float()).norm() <= 0.02 * u.float().norm()


def test_dropout_stream_on_gpu_is_per_replica_and_leaves_the_run_stream_alone():
    """The trainer's dropout stream on CUDA: the same (replica, step) draws the same masks, another replica other
    masks, and the device's own random state comes back as it was."""
    from types import SimpleNamespace

    from lowbit.distributed.mesh import DIMS, Mesh
    from lowbit.train.step import dropout_stream

    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=704, vocab_size=512, max_seq_len=256,
                     dropout=0.2)
    torch.manual_seed(0)
    model = Llama(args).cuda()
    x = torch.randint(0, 512, (2, 256), device="cuda")

    def loss_on(replica):
        mesh = Mesh({d: 2 if d == "dp" else 1 for d in DIMS}, {d: replica if d == "dp" else 0 for d in DIMS})
        device = torch.device("cuda", torch.cuda.current_device())
        run = SimpleNamespace(inputs=SimpleNamespace(args=args), device=device, mesh=mesh,
                              cfg=SimpleNamespace(train=SimpleNamespace(seed=0)), step=3)
        before = torch.cuda.get_rng_state()
        with dropout_stream(run), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, x).item()
        assert torch.equal(torch.cuda.get_rng_state(), before)
        return loss

    first, again, other = loss_on(0), loss_on(0), loss_on(1)
    assert first == again and first != other, (first, again, other)


@pytest.mark.parametrize("recipe", ["fp8-tensorwise", "fp8-delayed"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused_producers_step_matches_the_unfused_step_on_gpu(compiled, recipe):
    """numerics.fused_producers on the GPU (the producers' Triton kernels; compiled, kept as custom-op calls):
    two steps against the unfused ones (delayed: the first casts with its own amax, the second with the
    delayed scale, in one pass). Not bit for bit as on the CPU: the norm's Triton kernel sums a row in
    another order than torch's (or inductor's) reduction, so rstd may differ in its last bit, an amax with it,
    and every E5M2 gradient cast after it rounds anew (test_compiled_linears_keeping_their_inputs_match_eager_on_gpu:
    7-12% apart from any small change). So: the losses agree closely, and each fused gradient is as close to
    bf16's as the unfused one is."""
    import dataclasses

    from lowbit.numerics import kernels
    from lowbit.numerics.fused_producers import FP8RMSNorm
    from lowbit.numerics.recipes import convert, get_recipe

    if kernels.triton is None or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the producers' kernels need Triton and FP8 (compute capability 8.9 on)")

    def run(recipe, fused):
        torch.manual_seed(0)
        args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=768, vocab_size=512,
                         max_seq_len=128)
        model = Llama(args).cuda()
        convert(model, dataclasses.replace(get_recipe(recipe), fused_producers=fused))
        assert isinstance(model.layers[0].attention_norm, FP8RMSNorm) == fused
        fn = torch.compile(model) if compiled else model
        for seed in (1, 0):
            model.zero_grad()
            x = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(seed)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(x, x)
            loss.backward()
        torch._dynamo.reset()
        return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}

    (_, ref), (loss_u, unfused), (loss_f, fused) = (run("bf16", False), run(recipe, False), run(recipe, True))
    assert abs(loss_f - loss_u) <= 1e-3 * abs(loss_u), (loss_f, loss_u)
    for n, g in ref.items():
        err_u, err_f = ((t[n] - g).norm() / g.norm() for t in (unfused, fused))
        assert err_f <= 2 * err_u + 0.02, (n, err_f.item(), err_u.item())


@pytest.mark.parametrize("L,D", [(1000, 128), (2048, 64)])
def test_fp8_attention_kernel_matches_its_emulation_and_bf16_attention_on_gpu(L, D):
    from lowbit.numerics import attention as A

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    assert A.runs_kernel(q) and A.runs_kernel(q.transpose(1, 2).contiguous().transpose(1, 2))  # the model's view
    (q8, q_si), (k8, k_si), (v8, v_si) = A.quantize_heads(q), A.quantize_heads(k), A.quantize_heads(v)
    ops = (q8, k8, v8, q_si, k_si, v_si)  # triton_forward's and emulate's order: the data, then the scales
    sm = 1 / math.sqrt(D)
    out, lse = A.triton_forward(*ops, sm, torch.float32)
    ref, ref_lse = A.emulate(*ops, sm)
    # the same blocks and order of operations: what differs is the MMA's sums (Hopper's FP8 MMA accumulates with
    # fewer bits than fp32: 52.7 dB measured on an H200 at L=1000, D=128) and exp2's last bits, which can move a P
    # across an E4M3 rounding boundary (one P moves by up to 2^-4 of its weight); the emulation is exact fp32
    snr = lambda ref, x: 10 * torch.log10(ref.double().square().sum() / (x.double() - ref.double()).square().sum())
    assert snr(ref, out) > 45
    # measured on an H100: the largest output difference 0.025, lse's 2.9e-4 (the MMA's sums)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-3)
    core = torch.compile(A.FP8Attention(), fullgraph=True)
    got = core(q, k, v)
    assert got.dtype == torch.bfloat16 and torch.equal(got, A.FP8Attention()(q, k, v))  # the op, kept whole
    g = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), g)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact_grads = torch.autograd.grad(exact, (q, k, v), g)
    # the CPU's bounds (tests/test_fp8_attention.py), 1 dB lower for bf16's own rounding of the reference
    assert snr(exact, got) > 24
    for a, b, bound in zip(grads, exact_grads, (23, 23, 27)):
        assert snr(b, a) > bound
    # the backward is attention's at the dequantized operands with the FP8 out and lse: the math formula's
    qd, kd, vd = (A.dequantize_heads(*A.quantize_heads(t), torch.float32) for t in (q, k, v))
    out16, lse16 = torch.ops.lowbit.fp8_attention(q, k, v, sm)
    for a, b in zip(grads, A.math_backward(g, qd, kd, vd, out16, lse16, sm)):
        assert snr(b, a) > 35  # flash's bf16 backward against fp32 math


@pytest.mark.parametrize("scales", ["bound", "mixed"])
@pytest.mark.parametrize("graphs", [False, True])
def test_bounded_and_mixed_scales_step_as_amax_scales_do_over_steps_on_gpu(scales, graphs):
    """fp8lm-o2's storage, `scales` against MS-AMP's amax scales on the GPU path (Triton kernels, CUDA graphs
    replayed or not), each step from the same states copied in place (a gradient spike at step 6): a state whose
    scale comes from an amax has the amax run's scale; the others' scales are at most that; every stored value
    decodes to the amax run's, or its neighbour where the two kernels round an fp32 product apart, wherever it is
    a normal number at the lower scale."""
    from lowbit.optim import LowbitAdamW, StatePrecision
    from lowbit.optim.precision import decode
    from lowbit.optim.state_bounds import stored_amaxes

    prec = StatePrecision(weights="fp16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")
    kinds = ("e4m3", "fp16", "fp16", "nearest", True, scales)
    torch.manual_seed(0)
    shapes = ((768, 3072), (3072, 768))
    ref = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opts = [LowbitAdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, precision=pr, cuda_graphs=graphs)
            for ps, pr in ((ref, prec), (twin, StatePrecision(**{**prec.__dict__, "scales": scales})))]
    g = torch.Generator(device="cuda").manual_seed(1)
    names = ("exp_avg", "exp_avg_sq")
    lower = 0  # steps where a bounded scale sat below the amax's: the path under test is not amax's
    for step in range(12):
        if step:  # the twin starts from the amax run's states, in place (a graph's addresses stay)
            for p, q in zip(ref, twin):
                a, b = opts[0].state[p], opts[1].state[q]
                for k in names + ("exp_avg_scale", "exp_avg_sq_scale", "step"):
                    b[k].copy_(a[k])
                q._data.copy_(p._data), q._scale.copy_(p._scale)
                opts[1]._amax[q].copy_(stored_amaxes(kinds, b["exp_avg"], b["exp_avg_scale"], b["exp_avg_sq"],
                                                     b["exp_avg_sq_scale"], q._data, q._scale))
        grads = [torch.randn(s, device="cuda", generator=g) * (30 if step == 6 else 1) for s in shapes]
        for opt, ps in zip(opts, (ref, twin)):
            sum((p.float() * gr).sum() for p, gr in zip(ps, grads)).backward()
            opt.step()
            opt.zero_grad()
        for p, q in zip(ref, twin):
            a, b = opts[0].state[p], opts[1].state[q]
            for (x, xs, kind), (y, ys, _) in (((a["exp_avg"], a["exp_avg_scale"], "e4m3"),
                                               (b["exp_avg"], b["exp_avg_scale"], "e4m3")),
                                              ((a["exp_avg_sq"], a["exp_avg_sq_scale"], "fp16"),
                                               (b["exp_avg_sq"], b["exp_avg_sq_scale"], "fp16")),
                                              ((p._data, p._scale, "fp16"), (q._data, q._scale, "fp16"))):
                if kind == "e4m3" and scales == "mixed":
                    assert torch.equal(xs, ys), (step, xs, ys)
                assert ys <= xs, (step, kind, xs, ys)
                lower += int(ys < xs)
                normal = y.float().abs() >= (2 ** -6 if kind == "e4m3" else 2 ** -14)
                dx, dy = decode(x, kind, xs)[normal], decode(y, kind, ys)[normal]
                rel = (dx - dy).abs() / dx.abs().clamp_min(1e-30)
                assert rel.max().item() <= (2 ** -3 if kind == "e4m3" else 2 ** -10), (step, kind, rel.max().item())
                assert (dx != dy).float().mean().item() < 1e-3, (step, kind, (dx != dy).float().mean().item())
    assert lower > 0
    if graphs:  # a failed capture only warns and runs eagerly: the replayed update is what was compared
        assert opts[1]._graphed[("update", ref[0].device)].graph is not None


@pytest.mark.parametrize("graphs", [False, True])
def test_certified_weight_scales_write_what_the_weights_amax_pass_writes_on_gpu(graphs, monkeypatch):
    """fp8lm-o2 under amax scales on the GPU path (Triton kernels, CUDA graphs replayed or not), twelve steps with
    a gradient spike at step 6: with the weights' scale certified where bounds fix it (update_kernel.CERTIFY,
    the default) every state, scale and amax record is bit for bit the one the weights' amax pass gives, and
    after the first step most scales were certified."""
    from lowbit.optim import LowbitAdamW, StatePrecision, update_kernel

    prec = StatePrecision(weights="fp16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16")
    shapes = ((768, 3072), (3072, 768))
    ran = []
    real = update_kernel.update
    if not graphs:  # eager: every step's update called from Python (a capture cannot read a tensor back)
        monkeypatch.setattr(update_kernel, "update", lambda *a: ran.append(real(*a)[:, 12].sum().item()) or None)

    def run(certify: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(update_kernel, "CERTIFY", certify)
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        opt = LowbitAdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, precision=prec, cuda_graphs=graphs)
        g = torch.Generator(device="cuda").manual_seed(1)
        for step in range(12):
            grads = [torch.randn(s, device="cuda", generator=g) * (30 if step == 6 else 1) for s in shapes]
            sum((p.float() * gr).sum() for p, gr in zip(ps, grads)).backward()
            opt.step()
            opt.zero_grad()
        if graphs:
            assert opt._graphed[("update", ps[0].device)].graph is not None
        return [t.clone() for p in ps for t in (*opt.state[p].values(), p._data, p._scale, opt._amax[p])]

    full = run(False)
    ran.clear()
    for a, b in zip(full, run(True), strict=True):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if not graphs:  # one call per chunk
        assert 0 < sum(ran) < len(ran) / 2, ran



@pytest.mark.parametrize("scales", ["amax", "bound", "mixed"])
@pytest.mark.parametrize("graphs", [False, True])
def test_grouped_update_launches_write_what_one_launch_per_tensor_writes_on_gpu(graphs, scales, monkeypatch):
    """update_kernel.GROUP on a GPU: fp8lm-o2's update with the tensors of one shape in one launch per pass (their
    addresses from a table; CUDA graphs replayed or not, so a replay reads the table it was captured with) writes
    every state, scale and amax record bit for bit as one launch per tensor, over ten steps with a gradient
    spike."""
    from lowbit.optim import LowbitAdamW, StatePrecision, update_kernel

    prec = StatePrecision(weights="fp16", grads="e4m3", exp_avg="e4m3", exp_avg_sq="fp16", scales=scales)
    shapes = ((512, 1536),) * 3 + ((1536, 512),) * 2 + ((512,),) * 2
    tables = []
    real = update_kernel._table
    monkeypatch.setattr(update_kernel, "_table", lambda *a: tables.append(real(*a)) or tables[-1])

    def run(group: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(update_kernel, "GROUP", group)
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
        opt = LowbitAdamW(ps, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, precision=prec, cuda_graphs=graphs)
        g = torch.Generator(device="cuda").manual_seed(1)
        for step in range(10):
            grads = [torch.randn(s, device="cuda", generator=g) * (30 if step == 5 else 1) for s in shapes]
            sum((p.float() * gr).sum() for p, gr in zip(ps, grads)).backward()
            opt.step()
            opt.zero_grad()
        if graphs:
            assert opt._graphed[("update", ps[0].device)].graph is not None
        return [t.clone() for p in ps for t in (*opt.state[p].values(), p._data, p._scale)] + \
            [opt._amax[p].clone() for p in ps if p in opt._amax]

    apart = run(False)
    assert not tables
    for a, b in zip(apart, run(True), strict=True):
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    assert tables and all(t is not None for t in tables)
