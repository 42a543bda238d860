"""`lowbit bench gemm`: torch._scaled_mm (FP8) against the bf16 matmul on the GEMM shapes of a SwiGLU MLP; the
per-tensor quantization timing that `lowbit bench mlp` prints beside its table; `lowbit bench kernels`: that timing,
the fused cast + transpose and the fused producers (RMSNorm, SwiGLU writing FP8) against their unfused passes and the
memory floor."""

from __future__ import annotations

import itertools

import torch

from lowbit.tools.bench.common import (GPU_HBM_BYTES_PER_S, MLP, Report, Table, back_to_back_ms, error_row, graph_ms,
                                       release, time_ms)


def mlp_gemm_shapes(tokens: int, dim: int, hidden: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of out[M, N] = a[M, K] @ b[N, K]ᵀ for the 3 GEMMs of the MLP's two linear shapes."""
    return [("w1/w3 fprop", tokens, dim, hidden), ("w1/w3 dgrad", tokens, hidden, dim),
            ("w1/w3 wgrad", hidden, tokens, dim), ("w2 fprop", tokens, hidden, dim),
            ("w2 dgrad", tokens, dim, hidden), ("w2 wgrad", dim, tokens, hidden)]


def _gemm_fns(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The variants of a @ bᵀ: bf16, and FP8 E4M3 x E4M3 through torch._scaled_mm (unit scales: the scale's value
    does not change the kernel's time)."""
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device=a.device)
    row_a, row_b = torch.ones(a.shape[0], 1, device=a.device), torch.ones(1, b.shape[0], device=a.device)

    def scaled(sa, sb, fast):
        return lambda: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

    return {"bf16": lambda: a @ b.t(),
            "fp8 tensorwise": scaled(one, one, False),
            "fp8 tensorwise fast-accum": scaled(one, one, True),
            "fp8 rowwise fast-accum": scaled(row_a, row_b, True)}


def run_gemm(a, device: torch.device, report: Report) -> None:
    t = report.table(Table("gemm", f"GEMM ({a.tokens} tokens, dim {a.dim}, hidden {a.hidden})",
                           [("shape", "shape", ""), ("variant", "variant", ""), ("mkn", "M x K x N", ""),
                            ("ms", "ms (median)", ".3f"), ("tflops", "TFLOP/s", ".1f"),
                            ("speedup_vs_bf16", "vs bf16", ".2f")]))
    g = torch.Generator(device=device).manual_seed(0)
    for name, M, K, N in mlp_gemm_shapes(a.tokens, a.dim, a.hidden):
        x = torch.randn(M, K, device=device, generator=g).to(torch.bfloat16)
        w = torch.randn(N, K, device=device, generator=g).to(torch.bfloat16)
        bf16_ms = None
        for variant, fn in _gemm_fns(x, w).items():
            if variant == "bf16" and a.no_bf16:
                continue
            row = {"shape": name, "variant": variant, "mkn": f"{M} x {K} x {N}", "M": M, "K": K, "N": N}
            try:
                row.update(time_ms(fn, device, a.steps, a.warmup))
                row["tflops"] = 2 * M * K * N / row["ms"] / 1e9
                if variant == "bf16":
                    bf16_ms = row["ms"]
                elif bf16_ms:
                    row["speedup_vs_bf16"] = bf16_ms / row["ms"]
            except Exception as e:  # a combination this device lacks is a result too
                row.update(error_row(e))
            report.row(t, row)
        del x, w
    t.notes.append("E4M3 x E4M3 -> bf16 out; fast-accum skips the periodic fp32 promotion of partial sums (Hopper).")


def run_quantize(a, device: torch.device, report: Report) -> None:
    """Per-tensor E4M3 quantization (amax, scale, cast) of a tokens x dim bf16 tensor: lowbit's `quantize` and the
    plain formula, each compiled unless --eager (and lowbit's eagerly too where that runs its Triton kernels),
    against the memory floor (read 2 bytes, write 1 per element; and reading x twice);
    a.quantize_steps iterations (--steps, else 50 on a GPU)."""
    from lowbit.numerics import kernels
    from lowbit.numerics.qtensor import quantize
    from lowbit.numerics.scaling import Scaling

    t = report.table(Table("quantize", f"per-tensor E4M3 quantization, {a.tokens} x {a.dim} bf16",
                           [("variant", "variant", ""), ("ms", "ms (median)", ".4f"), ("gb_s", "GB/s", ".0f"),
                            ("ms_back_to_back", "ms back to back", ".4f"),
                            ("gb_s_back_to_back", "GB/s back to back", ".0f"),
                            ("ms_graph", "ms in a CUDA graph", ".4f"), ("gb_s_graph", "GB/s in a CUDA graph", ".0f")]))
    t.notes.append("ms: one call timed alone (its launch included: the GPU idles while the host runs the compiled "
                   "wrapper); back to back: the mean over the calls launched in a row, the kernels' own time "
                   "unless the host launches slower than they run; in a CUDA graph: 20 calls captured and replayed, "
                   "the kernels' time with no host launch at all. The calls cycle through 4 inputs, so that one "
                   "call does not find the last call's input in L2, as no quantization in training does")
    g = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(a.tokens, a.dim, device=device, generator=g).to(torch.bfloat16) for _ in range(4)]
    v = inputs[0]
    turn = itertools.cycle(inputs)
    spec = Scaling("e4m3")

    def plain(x):
        scale = 448.0 / x.abs().amax().float().clamp(min=1e-12)
        return (x.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reciprocal()

    def lowbit_q(x):
        q = quantize(x, spec)
        return q.data, q.scale_inv

    nbytes = v.numel() * 3
    variants = [("lowbit quantize", lowbit_q, a.compile), ("plain formula", plain, a.compile)]
    if a.compile and kernels.usable(v):  # eager on a GPU, lowbit's quantize is its Triton kernels
        variants.insert(1, ("lowbit quantize", lowbit_q, False))
    for name, fn, compiled in variants:
        f = torch.compile(fn) if compiled else fn
        triton = fn is lowbit_q and kernels.usable(v)
        row = {"variant": name + (" (compiled)" if compiled else " (eager, Triton)" if triton else " (eager)")}

        def call(f=f):  # the next of the inputs
            return f(next(turn))

        try:
            row.update(time_ms(call, device, a.quantize_steps, a.warmup))
            row["gb_s"] = nbytes / row["ms"] / 1e6
            row["ms_back_to_back"] = back_to_back_ms(call, device, a.quantize_steps)
            row["gb_s_back_to_back"] = nbytes / row["ms_back_to_back"] / 1e6
        except Exception as e:
            row.update(error_row(e))
        if device.type == "cuda" and "error" not in row:
            try:
                row["ms_graph"] = graph_ms(call, device)
                row["gb_s_graph"] = nbytes / row["ms_graph"] / 1e6
            except Exception as e:  # a capture that fails leaves the column empty, and says why
                row["graph_error"] = error_row(e)["error"]
                t.notes.append(f"{row['variant']}: no CUDA graph ({row['graph_error']})")
        report.row(t, row)
    bw = next((b for k, b in GPU_HBM_BYTES_PER_S.items() if k in report.meta["device"]), None)
    if bw:
        floor = nbytes / bw * 1e3
        report.row(t, {"variant": "memory floor (one pass)", "ms": floor, "gb_s": bw / 1e9})
        # the amax must be known before the cast: any kernel reads x twice (2 + 2 bytes read, 1 written)
        report.row(t, {"variant": "memory floor (amax, then cast)", "ms": floor * 5 / 3, "gb_s": bw / 1e9})


def _timed(call, device: torch.device, steps: int, warmup: int, nbytes: int, floor_ms: float | None) -> dict:
    """ms of `call` alone, back to back and in a CUDA graph (a GPU), GB/s of `nbytes`, and the best of those against
    `floor_ms` (the memory floor)."""
    row = time_ms(call, device, steps, warmup)
    row["ms_back_to_back"] = back_to_back_ms(call, device, steps)
    if device.type == "cuda":
        try:
            row["ms_graph"] = graph_ms(call, device)
        except Exception as e:  # a capture that fails leaves the column empty, and says why
            row["graph_error"] = error_row(e)["error"]
    best = row.get("ms_graph") or row["ms_back_to_back"]
    row["gb_s"] = nbytes / best / 1e6
    if floor_ms:
        row["vs_floor"] = best / floor_ms
    return row


def kernel_columns() -> list[tuple[str, str, str]]:
    return [("variant", "variant", ""), ("ms", "ms (median, alone)", ".4f"), ("ms_back_to_back", "ms back to back",
            ".4f"), ("ms_graph", "ms in a CUDA graph", ".4f"), ("gb_s", "GB/s", ".0f"), ("vs_floor", "vs floor", ".2f")]


def hbm_floor_ms(report: Report, nbytes: int) -> float | None:
    bw = next((b for k, b in GPU_HBM_BYTES_PER_S.items() if k in report.meta["device"]), None)
    return nbytes / bw * 1e3 if bw else None


def run_cast_transpose(a, device: torch.device, report: Report) -> None:
    """E4M3 of a tokens x dim bf16 tensor, row-major and transposed: lowbit's one pass (with a given scale, and
    with the amax too), the cast then a copy of the transposed bytes, inductor's kernel(s) for the same formula,
    and current scaling (the amax pass first) against the floor: one bf16 read and two FP8 writes at HBM speed."""
    from lowbit.numerics import kernels
    from lowbit.numerics.qtensor import cast
    from lowbit.numerics.scaling import Scaling

    spec = Scaling("e4m3")
    g = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(a.tokens, a.dim, device=device, generator=g).to(torch.bfloat16) for _ in range(4)]
    turn = itertools.cycle(inputs)  # no call finds its input in L2
    scale = torch.tensor(448.0 / 5.0, device=device)
    nbytes = inputs[0].numel() * 4  # 2 read, 1 + 1 written
    floor = hbm_floor_ms(report, nbytes)
    t = report.table(Table("cast_transpose", f"E4M3 cast + transpose, {a.tokens} x {a.dim} bf16", kernel_columns()))
    t.notes.append("vs floor: the CUDA-graph time (else back to back) against one bf16 read and two FP8 writes of the "
                   "tensor at the HBM bandwidth (the goal: at most 1.3). Inputs cycle through 4 tensors.")

    def formula(x, s):
        y = (x.float() * s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return y, y.t().contiguous()

    compiled = torch.compile(formula) if a.compile else None
    op = torch.ops.lowbit.cast_transpose
    variants = [("lowbit cast_transpose (one pass)", lambda x: op(x, scale, False, False)),
                ("lowbit cast_transpose + amax", lambda x: op(x, scale, False, True)),
                ("cast, then transpose the FP8 bytes", lambda x: (lambda y: (y, y.t().contiguous()))(
                    cast(x, scale, spec))),
                *([("formula compiled (inductor)", lambda x: compiled(x, scale))] if compiled else []),
                ("current scaling: amax pass + cast_transpose",
                 lambda x: op(x, 448.0 / (kernels.amax(x) if kernels.usable(x) else x.abs().amax().float()), False,
                              False))]
    for name, fn in variants:
        row = {"variant": name}
        try:
            row.update(_timed(lambda fn=fn: fn(next(turn)), device, a.quantize_steps, a.warmup, nbytes, floor))
        except Exception as e:
            row.update(error_row(e))
        report.row(t, row)
    default = (kernels.CT_BLOCK_M, kernels.CT_BLOCK_N, kernels.CT_WARPS)
    tiles = [(32, 128, 4), (64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 4)]
    for tile in (tiles if kernels.usable(inputs[0]) else []):
        kernels.CT_BLOCK_M, kernels.CT_BLOCK_N, kernels.CT_WARPS = tile  # other launch settings of the one pass
        row = {"variant": "lowbit cast_transpose, tile {} x {}, {} warps".format(*tile)}
        try:
            row.update(_timed(lambda: op(next(turn), scale, False, False), device, a.quantize_steps, a.warmup, nbytes,
                              floor))
        except Exception as e:
            row.update(error_row(e))
        finally:
            kernels.CT_BLOCK_M, kernels.CT_BLOCK_N, kernels.CT_WARPS = default
        report.row(t, row)
    if floor:
        report.row(t, {"variant": "memory floor (read 2 + write 1 + 1 bytes)", "ms": floor, "vs_floor": 1.0})


def _producer_variants(name: str, a, device: torch.device) -> tuple[list, list, int, int]:
    """(inputs, variants, bytes read once, elements written) of the SwiGLU (tokens x hidden) or the RMSNorm
    (tokens x dim) writing E4M3: unfused (the model's formula in bf16, then lowbit's quantize), the formula and
    its cast compiled (inductor fuses what it can), and lowbit's fused kernels by current scaling and with a given
    scale."""
    import torch.nn.functional as F

    from lowbit.numerics.producers import rmsnorm_fp8, swiglu_fp8
    from lowbit.numerics.qtensor import quantize
    from lowbit.numerics.scaling import Scaling

    spec, scale = Scaling("e4m3"), torch.tensor(448.0 / 40.0, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    cols = a.hidden if name == "swiglu" else a.dim
    rand = [torch.randn(a.tokens, cols, device=device, generator=g).to(torch.bfloat16) for _ in range(8)]
    w = torch.rand(cols, device=device, generator=g) + 0.5
    if name == "swiglu":
        inputs = list(zip(rand[:4], rand[4:]))
        formula = lambda x: F.silu(x[0]) * x[1]  # noqa: E731
        fused = [("fused, current scaling (amax pass + cast)", lambda x: swiglu_fp8(*x, spec)),
                 ("fused, given scale (one pass + amax)", lambda x: swiglu_fp8(*x, spec, scale))]
    else:
        inputs = [(x,) for x in rand[:4]]
        formula = lambda x: w * (x[0].float() * torch.rsqrt(x[0].float().pow(2).mean(-1, keepdim=True)  # noqa: E731
                                                            + 1e-5)).to(x[0].dtype)
        fused = [("fused, current scaling (amax pass + cast)", lambda x: rmsnorm_fp8(x[0], w, 1e-5, spec)),
                 ("fused, given scale (one pass + amax)", lambda x: rmsnorm_fp8(x[0], w, 1e-5, spec, scale))]

    def plain(x):
        h = formula(x)
        amax = h.abs().amax().float()
        return (h.float() * (448.0 / amax)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)

    variants = [("unfused: formula, then lowbit quantize (eager)", lambda x: quantize(formula(x), spec))]
    if a.compile:
        variants.append(("formula and current-scaled cast compiled (inductor)", torch.compile(plain)))
    return inputs, variants + fused, len(inputs[0]) * 2 * a.tokens * cols, a.tokens * cols


def run_producers(a, device: torch.device, report: Report) -> None:
    """The fused producers against their unfused passes and the floor of one read of the inputs and one FP8
    write (current scaling cannot reach it: its amax must be known before the cast, so it reads the inputs twice)."""
    for name, title in (("swiglu", f"SwiGLU silu(a)·b to E4M3, {a.tokens} x {a.hidden} bf16"),
                        ("rmsnorm", f"RMSNorm to E4M3, {a.tokens} x {a.dim} bf16")):
        inputs, variants, read, written = _producer_variants(name, a, device)
        floor = hbm_floor_ms(report, read + written)
        t = report.table(Table(f"{name}_fp8", title, kernel_columns()))
        t.notes.append("vs floor: against one read of the inputs and one FP8 write at the HBM bandwidth; GB/s counts "
                       "those bytes. Inputs cycle through 4 sets.")
        turn = itertools.cycle(inputs)
        for variant, fn in variants:
            row = {"variant": variant}
            try:
                row.update(_timed(lambda fn=fn: fn(next(turn)), device, a.quantize_steps, a.warmup, read + written,
                                  floor))
            except Exception as e:
                row.update(error_row(e))
            report.row(t, row)
        if floor:
            report.row(t, {"variant": "memory floor (inputs read once, FP8 written)", "ms": floor, "vs_floor": 1.0})
        del inputs, variants
        release(device)


class FusedTailMLP(torch.nn.Module):
    """A converted SwiGLU MLP whose product silu(w1 x)·(w3 x) goes to w2 as FP8 directly (numerics.fused_mlp)."""

    def __init__(self, mlp: torch.nn.Module):
        super().__init__()
        self.w1, self.w3, self.w2 = mlp.w1, mlp.w3, mlp.w2

    def forward(self, x):
        from lowbit.numerics.fused_mlp import swiglu_linear

        return swiglu_linear(self.w1(x), self.w3(x), self.w2.weight, self.w2.recipe)


def run_mlp_fused(a, device: torch.device, report: Report) -> None:
    """The SwiGLU MLP fwd+bwd (tokens x dim -> hidden -> dim, bf16): bf16, fp8-tensorwise unfused, and with the
    fused tail (FusedTailMLP), eagerly and compiled (the fused kernels stay calls of their custom ops)."""
    from lowbit.numerics.recipes import convert, get_recipe

    t = report.table(Table("mlp_fused", f"SwiGLU MLP {a.dim} -> {a.hidden} -> {a.dim}, {a.tokens} tokens, fwd+bwd",
                           [("variant", "variant", ""), ("ms", "ms (median)", ".3f"), ("tflops", "TFLOP/s", ".1f"),
                            ("speedup_vs_bf16", "vs bf16", ".3f")]))
    torch.manual_seed(0)
    base = MLP(a.dim, a.hidden).to(device, torch.bfloat16)
    x = torch.randn(a.tokens, a.dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(a.tokens, a.dim, device=device, dtype=torch.bfloat16)
    fp8 = MLP(a.dim, a.hidden).to(device, torch.bfloat16)
    fp8.load_state_dict(base.state_dict())
    convert(fp8, get_recipe("fp8-tensorwise"))
    modes = [False, True] if a.compile else [False]
    variants = [(f"bf16{' (compiled)' if c else ''}", base, c) for c in modes]
    variants += [(f"lowbit fp8-tensorwise{' (compiled)' if c else ' (eager)'}", fp8, c) for c in modes]
    variants += [(f"lowbit fp8-tensorwise, fused tail{' (compiled)' if c else ' (eager)'}", FusedTailMLP(fp8), c)
                 for c in modes]
    for name, m, compiled in variants:
        fn = torch.compile(m) if compiled else m
        row = {"variant": name}

        def step(fn=fn, m=m):
            x.grad = None
            m.zero_grad(set_to_none=True)
            fn(x).backward(dy)

        try:
            row.update(time_ms(step, device, a.steps, a.warmup))
            row["tflops"] = 3 * 6 * a.tokens * a.dim * a.hidden / row["ms"] / 1e9
        except Exception as e:
            row.update(error_row(e))
        report.row(t, row)
        release(device)
    for r in t.rows:  # against bf16 in the same mode
        ref = next((b for b in t.rows if b["variant"].startswith("bf16") and ("compiled" in b["variant"]) ==
                    ("compiled" in r["variant"]) and "ms" in b), None)
        if ref and "ms" in r:
            r["speedup_vs_bf16"] = ref["ms"] / r["ms"]
    t.notes.append("vs bf16: against bf16 in the same mode (eager or compiled). The fused tail: silu(w1 x)·(w3 x) "
                   "written as FP8 for w2 (numerics.fused_mlp; current scaling: an amax pass, then the cast), W2 and "
                   "dy cast with their transposes in one pass; w1 and w3 as fp8-tensorwise.")


def run_kernels(a, device: torch.device, report: Report) -> None:
    run_quantize(a, device, report)
    run_cast_transpose(a, device, report)
    run_producers(a, device, report)
    run_mlp_fused(a, device, report)
