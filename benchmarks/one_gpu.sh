#!/usr/bin/env bash
# BENCHMARKS.md's one-GPU tables outside the FP8-LM section (that one is fp8lm_scale.sh's): each part runs the
# command its table names and writes $OUT/<the result file's name>.json (the bench's output beside it, as
# <name>_log.txt), ready to be copied into benchmarks/results/ and rendered by `python benchmarks/report.py`.
#
#   bash benchmarks/one_gpu.sh step-1b       # the 1b step: bf16, fp8-tensorwise, torchao (alone and in a row)
#   bash benchmarks/one_gpu.sh profile-1b    # where the 1b step's time goes: bf16, fp8-tensorwise, fp8-delayed,
#                                            # torchao
#   bash benchmarks/one_gpu.sh recipes-1b    # the 1b step of fp8lm-o2, nanotron-r2, fp4 beside fp8-tensorwise
#   bash benchmarks/one_gpu.sh graphs-1b     # fp8lm-o2 and nanotron-r2 with and without the optimizer's CUDA graphs
#   bash benchmarks/one_gpu.sh mlp           # the 7B MLP and the quantization, compiled and eager; the Triton sweep
#   bash benchmarks/one_gpu.sh gemm          # the 7B MLP's GEMMs
#   bash benchmarks/one_gpu.sh memory        # activations saved for backward at 1b
#   bash benchmarks/one_gpu.sh compile       # 125m: regional against whole-model compilation, and its profile
#   bash benchmarks/one_gpu.sh occ           # one OCC linear (fp4) against fp8-tensorwise
#   bash benchmarks/one_gpu.sh performer     # Performer against SDPA flash attention
#
# Env: OUT (default ./out), TAG (the device in the file names, default h200), LIMIT_S (seconds per command, default
# 600). torchao comes from wheels in .whl/ when present.
set -uo pipefail
PARTS="step-1b profile-1b recipes-1b graphs-1b mlp gemm memory compile occ performer"
case " $PARTS " in
  *" ${1:-none} "*) ;;
  *) echo "usage: bash benchmarks/one_gpu.sh PART, one of: $PARTS" >&2; exit 2 ;;
esac
OUT=${OUT:-out}; mkdir -p "$OUT"
TAG=${TAG:-h200}
LIMIT_S=${LIMIT_S:-600}
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:src
fi
bench() {  # bench NAME ARGS...: lowbit bench ARGS --out $OUT/NAME_$TAG.json, its output in $OUT/NAME_${TAG}_log.txt
  local name=${1}_$TAG; shift
  timeout "$LIMIT_S" python3 -m lowbit bench "$@" --out "$OUT/$name.json" > "$OUT/${name}_log.txt" 2>&1
  echo "== $name (exit $?)"; grep -v -E '^\{|^[WIEV][0-9]{4}' "$OUT/${name}_log.txt" | tail -n 20
}
S1B=(--steps 20 --warmup 3 --compile-scope blocks)
case "${1:-}" in
  step-1b) bench step_1b_torchao step "${S1B[@]}" --recipes bf16,fp8-tensorwise --torchao tensorwise ;;
  profile-1b) bench step_1b_profile step "${S1B[@]}" --recipes bf16,fp8-tensorwise,fp8-delayed --torchao tensorwise \
      --profile ;;
  recipes-1b) TORCH_LOGS=recompiles bench step_1b_recipes step "${S1B[@]}" --no-bf16 --torchao none --profile \
      --recipes fp8-tensorwise,fp8lm-o2,nanotron-r2,fp4 ;;
  graphs-1b)
    graphs=fp8lm-o2+optim.cuda_graphs=false,fp8lm-o2,fp8-tensorwise,nanotron-r2+optim.cuda_graphs=false,nanotron-r2
    bench step_1b_cuda_graphs step "${S1B[@]}" --no-bf16 --torchao none --profile --recipes "$graphs" ;;
  mlp)
    bench mlp_7b mlp --recipes bf16,fp8-tensorwise --torchao tensorwise
    bench mlp_7b_eager mlp --eager --recipes bf16,fp8-tensorwise --torchao tensorwise
    LOWBIT_TRITON=0 bench mlp_7b_eager_torch mlp --eager --recipes fp8-tensorwise --no-bf16 --torchao none
    timeout "$LIMIT_S" python3 benchmarks/quantize_sweep.py --out "$OUT/quantize_sweep_$TAG.json" \
      > "$OUT/quantize_sweep_${TAG}_log.txt" 2>&1; echo "== quantize_sweep (exit $?)" ;;
  gemm) bench gemm_7b_mlp gemm ;;
  memory) bench memory_1b memory --eager --recipes bf16,fp8-tensorwise,fp8-tensorwise-coat --torchao tensorwise ;;
  compile)
    for scope in blocks model; do
      bench compile_scope_125m_$scope step --preset 125m --steps 10 --warmup 2 --recipes fp8-tensorwise --no-bf16 \
        --torchao none --compile-scope $scope
    done
    bench step_125m_profile step --preset 125m --steps 10 --warmup 2 --recipes bf16,fp8-tensorwise --torchao none \
      --compile-scope blocks --profile ;;
  occ) timeout "$LIMIT_S" python3 benchmarks/occ_linear.py --device cuda --tokens 16384 --dims 1024,4096 \
      --recipes fp4,fp4:sparse,fp4-no-occ,fp8-tensorwise > "$OUT/occ_linear_$TAG.txt" 2>&1
    echo "== occ_linear (exit $?)"; tail -n 12 "$OUT/occ_linear_$TAG.txt" ;;
  performer) timeout "$LIMIT_S" python3 benchmarks/performer.py --chunks 256,1024 --profile 16384 \
      --out "$OUT/performer_$TAG.json" 2>&1 | tail -n 20 ;;
esac
