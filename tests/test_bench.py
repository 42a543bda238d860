"""`lowbit bench`: every subcommand runs on the CPU at tiny shapes, prints its tables with the metadata, and writes
JSON with the metadata and a row for bf16 and for an FP8 recipe."""

import json
import os

import pytest

from conftest import cli
from lowbit.tools.bench.common import torchao_module
from lowbit.tools.bench.kernels import mlp_gemm_shapes
from lowbit.tools.bench.memory import SavedBytes

FAST = ["--device", "cpu", "--steps", "1", "--warmup", "0"]
SHAPES = {
    "gemm": ["--tokens", "32", "--dim", "32", "--hidden", "64"],
    "linear": ["--tokens", "32", "--dim", "32", "--hidden", "64"],
    "mlp": ["--tokens", "32", "--dim", "32", "--hidden", "64"],
    "kernels": ["--tokens", "32", "--dim", "48", "--hidden", "64"],
    "block": ["--preset", "tiny", "--batch", "2", "--seq", "16"],
    "step": ["--preset", "tiny", "--batch", "2", "--seq", "16", "--vocab", "256"],
    "memory": ["--preset", "tiny", "--batch", "2", "--seq", "16", "--vocab", "256"],
    "optim": ["--preset", "tiny", "--seq", "16", "--vocab", "256", "--recipes", "fp8-tensorwise,fp8lm-o2"],
    "attention": ["--seqs", "32,48", "--heads", "2", "--head-dim", "16", "--tokens", "64"],
}
TABLE = {"kernels": "cast_transpose",
         "gemm": "gemm", "linear": "linear", "mlp": "mlp", "block": "block", "step": "step", "memory": "memory",
         "optim": "optim", "attention": "attention"}


@pytest.mark.parametrize("what", list(SHAPES))
def test_bench_subcommand(what, tmp_path, capsys):
    out = tmp_path / f"{what}.json"
    fast = FAST[:2] if what == "memory" else FAST  # memory times nothing: it has no --steps/--warmup
    code, stdout, _ = cli(capsys, "bench", what, *fast, *SHAPES[what], "--out", out)
    assert code == 0
    doc = json.loads(out.read_text())
    meta = doc["meta"]
    for key in ("device", "torch", "date", "command", "torchao"):
        assert key in meta
    assert doc["complete"] is True and doc["what"] == what
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the tables drawn beside the JSON
    assert f"torch {meta['torch']}" in stdout and meta["date"] in stdout and "bench " + what in meta["command"]
    rows = doc["tables"][TABLE[what]]["rows"]
    assert all("error" not in r for r in rows), rows
    names = {r["variant"] for r in rows}
    if what == "attention":  # each length, both passes, both variants, the FP8 one with its ratio to bf16
        assert names == {"bf16 sdpa", "lowbit fp8"} and len(rows) == 2 * 2 * 2
        assert all(r["speedup_vs_bf16"] > 0 for r in rows) and {r["batch"] for r in rows} == {2, 1}
    elif what == "gemm":
        assert {"bf16", "fp8 tensorwise"} <= names
        assert len(rows) == 4 * len(mlp_gemm_shapes(32, 32, 64))
    elif what == "kernels":  # on the CPU: the op's torch formula; no floor without a known GPU
        assert names == {"lowbit cast_transpose (one pass)", "lowbit cast_transpose + amax",
                         "cast, then transpose the FP8 bytes",
                         "current scaling: amax pass + cast_transpose"}
        assert "quantize" in doc["tables"]
        for name in ("swiglu_fp8", "rmsnorm_fp8", "mlp_fused"):
            timed = doc["tables"][name]["rows"]
            assert len(timed) >= 3 and all("error" not in r and r["ms"] > 0 for r in timed), (name, timed)
        fused = doc["tables"]["mlp_fused"]["rows"]
        assert [r["variant"] for r in fused] == ["bf16", "lowbit fp8-tensorwise (eager)",
                                                 "lowbit fp8-tensorwise, fused tail (eager)"]
        assert all(r["speedup_vs_bf16"] > 0 for r in fused)
    else:
        assert {"bf16", "lowbit fp8-tensorwise"} <= names
    if what not in ("gemm", "kernels", "attention") and torchao_module() is None:
        assert "torchao is not installed" in stdout
    if what in ("gemm", "linear", "mlp", "block", "step", "optim", "attention"):
        assert all(r["ms"] > 0 and len(r["ms_each"]) == 1 for r in rows if r["variant"] != "memory floor (one pass)")
    if what == "mlp":
        quantize = doc["tables"]["quantize"]["rows"]
        assert {r["variant"] for r in quantize} >= {"lowbit quantize (eager)", "plain formula (eager)"}
        timed = [r for r in quantize if "floor" not in r["variant"]]
        assert timed and all(r["ms_back_to_back"] > 0 and r["gb_s_back_to_back"] > 0 for r in timed)
    if what == "step":
        assert all(r["tokens_per_s"] > 0 and r["flops_per_token"] > 0 and r["ms_in_a_row"] > 0 for r in rows)
        fp8 = next(r for r in rows if r["variant"] == "lowbit fp8-tensorwise")
        assert fp8["speedup_in_a_row_vs_bf16"] > 0
    if what == "optim":  # fp32 AdamW moves 28 bytes a parameter; fp8lm-o2's covered weights 11
        bf16, o2 = (next(r for r in rows if r["variant"] == v) for v in ("bf16", "lowbit fp8lm-o2"))
        assert bf16["bytes_per_param"] == 28 and 11 < o2["bytes_per_param"] < 28 and o2["gb_per_s"] > 0
        assert o2["vs_fp32_adamw"] == pytest.approx(o2["ms"] / bf16["ms"])
    if what == "memory":
        bf16 = next(r for r in rows if r["variant"] == "bf16")
        fp8 = next(r for r in rows if r["variant"] == "lowbit fp8-tensorwise")
        assert 0 < fp8["activations_mib"] < bf16["activations_mib"]  # FP8 saves its GEMM inputs in 1 byte
        assert fp8["activations_vs_bf16"] == pytest.approx(fp8["activations_mib"] / bf16["activations_mib"])


def test_saved_bytes_counts_each_storage_once_and_skips_parameters():
    import torch

    lin = torch.nn.Linear(8, 4)
    counter = SavedBytes(lin)
    x = torch.randn(3, 8, requires_grad=True)
    with counter.hooks():
        y = torch.relu(lin(x))
        (y * y).sum()
    assert counter.bytes["params"] == 8 * 4 * 4  # the weight, once
    assert counter.bytes["saved"] == 3 * 8 * 4 + 3 * 4 * 4  # x, and y (saved 3 times, counted once)


@pytest.mark.parametrize("args, needle", [
    (["nope"], "invalid choice"),
    ([], "required"),
    (["mlp", "--recipes", "fp9"], "fp9"),
    (["mlp", "--torchao", "columnwise"], "columnwise"),
    (["step", "--steps", "0"], "--steps"),
    (["gemm", "--device", "tpu"], "tpu"),
    (["gemm", "--recipes", "bf16"], "--recipes"),  # options a subcommand does not read are refused
    (["gemm", "--eager"], "--eager"),
    (["memory", "--steps", "3"], "--steps"),
    (["step", "--preset", "65b"], "65b"),
    (["memory", "--preset", "1b", "--vocab", "50000"], "--vocab"),
    (["block", "--preset", "65b"], "65b"),
    (["optim", "--shape", "4096"], "--shape"),
    (["step", "--max-batch", "-1"], "--max-batch"),
    (["mlp", "--recipes", "fp8lm-o2+optim.rounding=stochastic"], "bench step"),  # a variant is a trainer's setting
    (["step", "--recipes", "fp8lm-o2+optim.nope=1"], "nope"),
    (["step", "--recipes", "fp8lm-o2+optim.rounding=up"], "optim.rounding"),
    (["step", "--recipes", "fp8lm-o2+train.lr=0.1"], "sets only optim.* keys"),
    (["optim", "--recipes", "fp8lm-o2+model.checkpointing=full"], "sets only optim.* keys\n"),
    (["step", "--recipes", "bf16+model.dim=64"], "model.sdpa_backend"),  # a preset's shape is not a variant
    (["block", "--recipes", "fp8-tensorwise+optim.lr=1"], "sets only numerics.fused_producers\n"),
])
def test_bench_user_errors_are_one_line(args, needle, capsys):
    code, _, err = cli(capsys, "bench", *args)
    assert code == 2
    assert err.count("\n") == 1 and needle in err and "Traceback" not in err


def test_bench_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, _, err = cli(capsys, "bench", "gemm", *FAST, *SHAPES["gemm"], "--out", blocker / "sub" / "o.json")
    assert code == 2 and "--out" in err and err.count("\n") == 1


def test_bench_out_is_valid_json_from_the_start_and_absent_after_bad_input(tmp_path, capsys):
    from lowbit.tools.bench.common import Report

    out = tmp_path / "o.json"
    code, _, _ = cli(capsys, "bench", "step", "--preset", "65b", "--out", out)
    assert code == 2 and not out.exists()
    Report("gemm", {"device": "cpu"}, {}, str(out))
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["tables"] == {} and doc["meta"] == {"device": "cpu"}


def test_bench_no_bf16_skips_the_baseline(tmp_path, capsys):
    out = tmp_path / "o.json"
    code, _, _ = cli(capsys, "bench", "linear", *FAST, *SHAPES["linear"], "--no-bf16", "--torchao", "none",
                     "--out", out)
    assert code == 0
    rows = json.loads(out.read_text())["tables"]["linear"]["rows"]
    assert [r["variant"] for r in rows] == ["lowbit fp8-tensorwise"] and "speedup_vs_bf16" not in rows[0]


def test_saved_bytes_keeps_no_graph_alive():
    """The counting forward leaves no reference cycle: once closed, its saved activations are freed."""
    import weakref

    import torch

    lin = torch.nn.Linear(8, 4)
    counter = SavedBytes(lin)
    with counter.hooks():
        y = torch.relu(lin(torch.randn(3, 8, requires_grad=True)))
        z = y * y
    refs = [weakref.ref(t) for t in counter.kept.values()]
    del y, z
    counter.close()
    assert len(refs) >= 2 and all(r() is None for r in refs)


def test_plot_draws_every_table_with_rows_and_skips_errors(tmp_path, monkeypatch):
    """A panel per table with a measured row (error rows drawn as their message; the profile's dropped), none for
    a table of errors only, and no file when nothing was measured."""
    from lowbit.tools.bench import plot

    drawn = []
    monkeypatch.setattr(plot, "_label", lambda r, f=plot._label: drawn.append(r["variant"]) or f(r))
    kinds = {k: 10.0 for k in plot.KINDS}
    doc = {"meta": {"device": "X", "torch": "2", "date": "d", "command": "c"}, "tables": {
        "step": {"title": "t", "rows": [{"variant": "bf16", "ms": 2.0}, {"variant": "a", "error": "boom"},
                                        {"variant": "b", "ms": 1.0}, {"variant": "b", "ms": float("nan")}]},
        "profile": {"title": "p", "rows": [{"variant": "p-only", **kinds}, {"variant": "p-err", "error": "x"}]},
        "empty": {"title": "e", "rows": [{"variant": "c", "error": "boom"}]}}}
    png = plot.plot(doc, tmp_path / "x.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert drawn == ["bf16", "a", "b", "p-only"]  # the NaN row is no measurement; p-err and c are not drawn
    assert plot.plot({"tables": {"empty": doc["tables"]["empty"], "profile": {"rows": []}}},
                     tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


@pytest.mark.slow
def test_lowbit_triton_0_turns_the_kernels_off():
    import subprocess
    import sys

    code = "from lowbit.numerics import kernels; print(kernels.ENABLED)"
    out = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "LOWBIT_TRITON": v}, capture_output=True,
                          text=True, check=True).stdout.strip() for v in ("0", "1")]
    assert out == ["False", "True"]


def test_bench_step_profile_times_the_phases(tmp_path, capsys):
    out = tmp_path / "step.json"
    code, stdout, _ = cli(capsys, "bench", "step", *FAST, *SHAPES["step"], "--torchao", "none", "--profile",
                          "--out", out)
    assert code == 0 and "where the step's time goes" in stdout
    rows = json.loads(out.read_text())["tables"]["profile"]["rows"]
    assert [r["variant"] for r in rows] == ["bf16", "lowbit fp8-tensorwise"]
    for r in rows:
        assert all(r[f"{p}_ms"] > 0 and r[f"host_{p}_ms"] > 0 for p in ("forward", "backward", "optimizer")), r
        assert r["host_wait_ms"] >= 0


def test_profile_kernel_kinds_and_idle_union():
    from lowbit.tools.bench.profile import covered, idle, kind

    assert kind("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    assert kind("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128") == "gemm"
    assert kind("triton_tem_fused_mm_0") == "gemm"
    assert kind("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
                "cutlass::bfloat16_t, Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t>>>") == "attention"
    assert kind("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1") == "attention"
    # inductor's kernels by the ops they list: quantization alone, fused into bf16's work, or bf16's work only
    assert kind("triton_red_fused_abs_amax_19") == "quant"
    assert kind("triton_poi_fused__scaled_mm__to_copy_clamp_expand_mul_t_21") == "quant"
    assert kind("triton_per_fused__to_copy_abs_max_mul_view_27") == "quant"  # torchao's amax: abs + max
    assert kind("triton_red_fused_abs_amax_mul_silu_silu_backward_view_4") == "fused_quant"
    assert kind("triton_red_fused_abs_add_amax_mean_mul_pow_rsqrt_view_0") == "fused_quant"
    assert kind("triton_poi_fused__unsafe_view_mul_silu_8") == "fused"
    assert kind("triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_6") == "fused"
    # lowbit's own Triton kernels, eager aten kernels touching FP8, the rest
    assert kind("_cast_transpose_kernel") == kind("_amax_kernel") == kind("_cast_kernel") == "quant"
    assert kind("_rmsnorm_fp8_kernel") == kind("_swiglu_fp8_kernel") == kind("_swiglu_fp8_t_kernel") == "fused_quant"
    assert kind("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::"
                "TensorIteratorBase&)::{lambda(c10::Float8_e4m3fn)#1}>") == "quant"
    assert kind("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>") == "aten"
    assert kind("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata"
                ">") == "aten"
    assert covered([(0, 4), (2, 6), (10, 11), (10.5, 10.7)]) == 7  # overlaps counted once, the gap not at all
    assert idle(10.0, 7.5) == 2.5 and idle(10.0, 12.0) == 0.0  # the profiled step may outlast the timed one


def test_profile_side_by_side_puts_variants_in_columns_with_their_difference_to_bf16():
    from lowbit.tools.bench.profile import KIND_NAMES, side_by_side

    kinds = {f"{k}_ms": 1.0 for k in KIND_NAMES}
    rows = [{"variant": "bf16", **kinds, "quant_ms": 0.0, "fused_quant_ms": 0.0, "fused_ms": 30.0, "gemm_ms": 100.0,
             "idle_ms": 5.0, "step_ms": 140.0},
            {"variant": "lowbit fp8-tensorwise", **kinds, "quant_ms": 4.0, "fused_quant_ms": 35.0, "fused_ms": 14.0,
             "gemm_ms": 60.0, "idle_ms": 4.0, "step_ms": 120.0},
            {"variant": "broken", "error": "out of memory"}]
    lines = side_by_side(rows).split("\n")
    assert lines[0] == "| kernel time by kind, ms per step | bf16 | lowbit fp8-tensorwise |"  # no column for an error
    lines = lines[:lines.index("")]  # the notes follow
    table = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:] for line in lines[2:]}
    assert table["GEMM"] == ["100.0", "60.0 (-40.0) |"]
    assert table["quantization"] == ["0.0", "4.0 (+4.0) |"]
    assert table["quantization + fused, all"] == ["30.0", "53.0 (+23.0) |"]  # 4 + 35 + 14 against 0 + 0 + 30
    assert table["GPU idle"] == ["5.0", "4.0 (-1.0) |"] and table["step (timed)"] == ["140.0", "120.0 (-20.0) |"]


def test_bench_step_variant_trains_with_its_setting(tmp_path, capsys, monkeypatch):
    import lowbit.train.trainer as trainer

    built = []
    real = trainer.build_optimizer
    monkeypatch.setattr(trainer, "build_optimizer", lambda *a: built.append(a[2].rounding) or real(*a))
    out = tmp_path / "step.json"
    variant = "fp8lm-o2+optim.rounding=stochastic"
    code, stdout, _ = cli(capsys, "bench", "step", *FAST, *SHAPES["step"], "--torchao", "none", "--no-bf16",
                          "--recipes", f"fp8lm-o2,{variant}", "--out", out)
    assert code == 0
    rows = json.loads(out.read_text())["tables"]["step"]["rows"]
    assert [r["variant"] for r in rows] == ["lowbit fp8lm-o2", f"lowbit {variant}"]
    assert all("error" not in r and r["ms"] > 0 for r in rows), rows
    assert built == ["nearest", "stochastic"]


def test_bench_block_variant_installs_the_fused_producers(tmp_path, capsys, monkeypatch):
    """`bench block`'s one variant, numerics.fused_producers=true, times the block with its FP8 norms and SwiGLU."""
    import lowbit.tools.bench.layers as layers
    from lowbit.numerics.fused_producers import FP8RMSNorm, FP8SwiGLU

    seen = []
    real = layers.apply_variant
    def recording(base, v):
        m = real(base, v)
        seen.append(sorted({type(x).__name__ for x in m.modules() if isinstance(x, (FP8RMSNorm, FP8SwiGLU))}))
        return m

    monkeypatch.setattr(layers, "apply_variant", recording)
    out = tmp_path / "block.json"
    code, _, _ = cli(capsys, "bench", "block", *FAST, *SHAPES["block"], "--torchao", "none", "--no-bf16",
                     "--recipes", "fp8-tensorwise,fp8-tensorwise+numerics.fused_producers=true", "--out", out)
    assert code == 0
    assert seen == [[], ["FP8RMSNorm", "FP8SwiGLU"]]
    rows = json.loads(out.read_text())["tables"]["block"]["rows"]
    assert [r["variant"] for r in rows if "ms" in r] == ["lowbit fp8-tensorwise",
                                                          "lowbit fp8-tensorwise+numerics.fused_producers=true"]


def test_bench_step_variant_takes_numerics_settings(tmp_path, capsys, monkeypatch):
    """The recipe is resolved as the trainer resolves it: a [numerics] filter in a variant changes what is covered."""
    import lowbit.numerics.recipes as recipes

    covered = []
    real = recipes.convert
    def counting(model, recipe):
        out = real(model, recipe)
        covered.append(sum(hasattr(m, "recipe") for m in model.modules()))
        return out

    monkeypatch.setattr(recipes, "convert", counting)
    out = tmp_path / "step.json"
    code, _, _ = cli(capsys, "bench", "step", *FAST, *SHAPES["step"], "--torchao", "none", "--no-bf16",
                     "--recipes", "fp8-tensorwise,fp8-tensorwise+numerics.keep_first_last=true", "--out", out)
    assert code == 0
    assert len(covered) == 2 and covered[1] < covered[0]


def test_bench_step_variant_computes_attention_with_its_kernel(tmp_path, capsys, monkeypatch):
    import lowbit.models.llama as llama

    seen = set()
    real = llama.sdpa_order
    monkeypatch.setattr(llama, "sdpa_order", lambda backend, q: seen.add(backend) or real(backend, q))
    code, _, _ = cli(capsys, "bench", "step", *FAST, *SHAPES["step"], "--torchao", "none", "--no-bf16",
                     "--recipes", "fp8-tensorwise+model.sdpa_backend=math", "--out", tmp_path / "step.json")
    assert code == 0
    assert seen == {"math"}


def test_bench_optim_one_weight(tmp_path, capsys):
    out = tmp_path / "o.json"
    code, _, _ = cli(capsys, "bench", "optim", *FAST, "--shape", "64x48", "--recipes", "fp8lm-o3", "--out", out)
    assert code == 0
    rows = json.loads(out.read_text())["tables"]["optim"]["rows"]
    o3 = next(r for r in rows if r["variant"] == "lowbit fp8lm-o3")
    assert o3["params_m"] == pytest.approx(64 * 48 / 1e6) and o3["covered_pct"] == 100
    assert o3["bytes_per_param"] == 2 + 1 + 1 + 2 + 1 + 2 + 2 + 2  # read master, grad, m, v; write m, v, w, master


@pytest.mark.slow
def test_bench_step_max_batch_finds_the_largest_batch_that_fits(tmp_path, capsys, monkeypatch):
    """Out of memory above 5 sequences (a stand-in for the GPU's limit): the search tries 1, 2, 4, 8, 6, 5 and
    times the step at 5."""
    import torch

    from lowbit.tools.bench import capacity

    real = capacity._step_fn

    def limited(fwd, opt, device):
        step = real(fwd, opt, device)

        def run(x, y):
            if x.shape[0] > 5:
                raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
            step(x, y)
        return run

    monkeypatch.setattr(capacity, "_step_fn", limited)
    out = tmp_path / "o.json"
    code, _, _ = cli(capsys, "bench", "step", *FAST, *SHAPES["step"], "--max-batch", "16", "--torchao", "none",
                     "--out", out)
    assert code == 0
    rows = json.loads(out.read_text())["tables"]["capacity"]["rows"]
    assert [r["max_batch"] for r in rows] == [5, 5]
    assert rows[0]["tried"] == "1, 2, 4, 8 (oom), 6 (oom), 5"
    assert all(r["tokens_per_s"] == pytest.approx(5 * 16 / (r["ms"] / 1e3)) for r in rows)
    assert rows[0]["tokens_vs_bf16"] == 1


def test_largest_batch_search():
    from lowbit.tools.bench.capacity import largest_batch

    for cap in range(1, 20):
        for limit in range(0, 24):
            assert largest_batch(lambda b: b <= limit, cap) == min(limit, cap)
            for miss in (-3, -1, 0, 1, 4):  # a prediction off by `miss`: still the exact answer, in few tries
                tried = []
                fits = lambda b: tried.append(b) or b <= limit  # noqa: E731
                got = largest_batch(fits, cap, lambda: max(1, limit + miss) if len(tried) >= 2 else None)
                assert got == min(limit, cap), (cap, limit, miss, tried)
                assert len(tried) <= 2 + abs(miss) + 2
    tried = []  # a prediction far too high (torchao's at 7b: 32 for 9) turns to bisection after two misses
    assert largest_batch(lambda b: tried.append(b) or b <= 9, 32, lambda: 32 if len(tried) >= 2 else None) == 9
    assert len(tried) <= 10, tried


def test_linear_memory_guess():
    from lowbit.tools.bench.capacity import _linear_guess

    assert _linear_guess({1: 10.0}, 100.0) is None
    assert _linear_guess({1: 10.0, 2: 17.0, 4: 31.0}, 100.0) == 13  # 3 + 7 b <= 100


def test_bench_optim_update_paths(tmp_path, capsys):
    """--update compiled times the torch passes; the Triton kernels need a GPU, refused up front on a CPU."""
    out = tmp_path / "o.json"
    code, _, _ = cli(capsys, "bench", "optim", *FAST, "--shape", "32x16", "--recipes", "fp8lm-o2", "--update",
                     "compiled", "--out", out)
    assert code == 0
    assert {r["variant"] for r in json.loads(out.read_text())["tables"]["optim"]["rows"]} == {"bf16",
                                                                                          "lowbit fp8lm-o2"}
    code, _, err = cli(capsys, "bench", "optim", *FAST, "--shape", "32x16", "--update", "both", "--out", out)
    assert code == 2 and "needs a GPU with Triton" in err


def test_bench_optim_profile_splits_a_step_by_pass(monkeypatch):
    """`bench optim --profile`'s row: the kernel time of each Triton pass by its kernel's name, the rest as other
    kernels, and the timed step less the kernels' busy time as time with no kernel running."""
    import torch

    from lowbit.tools.bench import optim, profile

    top = [{"kernel": "_write_kernel", "kind": "aten", "ms": 30.0, "calls": 40},
           {"kernel": "_amax_kernel", "kind": "aten", "ms": 9.0, "calls": 40},
           {"kernel": "_weights_amax_kernel", "kind": "aten", "ms": 0.5, "calls": 40},
           {"kernel": "multi_tensor_apply_kernel", "kind": "aten", "ms": 1.5, "calls": 3}]
    fake = {f"{k}_ms": 0.0 for k in profile.KIND_NAMES}
    fake.update(aten_ms=41.0, kernels=123, busy_ms=40.5, top=top)
    monkeypatch.setattr(profile, "kernel_ms", lambda step, device, top=12: fake)
    row = optim._profile(lambda: None, torch.device("cuda"), 43.0)
    assert (row["writes_ms"], row["pass_one_ms"], row["weights_pass_ms"]) == (30.0, 9.0, 0.5)
    assert row["other_kernels_ms"] == 1.5 and row["launches"] == 123 and row["idle_ms"] == 2.5
    monkeypatch.setattr(profile, "kernel_ms", lambda step, device, top=12: {})  # a CPU: nothing to split
    assert optim._profile(lambda: None, torch.device("cpu"), 43.0) == {}
