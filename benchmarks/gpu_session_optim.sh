#!/usr/bin/env bash
# Device calls for the FP8-LM optimizer (issue 4). Part "tests": GPU tests + optimizer tests on the GPU machine;
# part "bench": benchmarks/optim_1b.py. Output lands in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case "${1:-all}" in
  tests|all)
    timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_optim.py 2>&1 \
      | tee "$OUT/pytest_gpu_optim.txt" | tail -15 ;;&
  bench|all)
    timeout 540 python3 benchmarks/optim_1b.py --steps 10 --out "$OUT/optim_1b.json" 2>&1 | tee "$OUT/optim_1b.txt" \
      | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -30 ;;
esac
