#!/usr/bin/env bash
# Device calls for the FP8-LM optimizer (issue 4). Part "tests": GPU tests + optimizer tests on the GPU machine;
# part "bench": benchmarks/optim_1b.py. Output lands in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case "${1:-all}" in
  bench|all)
    timeout 500 python3 benchmarks/optim_1b.py --steps 10 --recipes bf16,fp8-tensorwise,fp8lm-o2 \
      --out "$OUT/optim_1b.json" 2>&1 | tee "$OUT/optim_1b.txt" | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -30 ;;&
  bench2|all)
    timeout 300 python3 benchmarks/optim_1b.py --steps 10 --recipes fp8lm,nanotron-r2 --no-optimizer-only \
      --out "$OUT/optim_1b_more.json" 2>&1 | tee "$OUT/optim_1b_more.txt" | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -12 ;;&
  tests|all)
    timeout 540 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_optim.py \
      "tests/test_linear.py::test_compiles_in_one_graph_and_backward_still_records" 2>&1 | tee "$OUT/pytest_gpu_optim.txt" | tail -15 ;;
esac
