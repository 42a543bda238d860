#!/usr/bin/env bash
# Device call for FP4 (issue 5): the 350m training step under bf16, fp8-tensorwise, fp4 and fp4-weights-only, and
# the GPU cost of the OCC quantile. Output lands in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
timeout 60 python3 benchmarks/occ_fidelity.py --device cuda --tokens 16384 --dim 1024 \
  --out "$OUT/occ_fidelity_gpu.json" 2>&1 | tee "$OUT/occ_fidelity_gpu.txt" | tail -7
timeout ${STEP_TIMEOUT:-420} python3 benchmarks/optim_1b.py --preset 350m --no-optimizer-only --steps 10 \
  --recipes ${RECIPES:-bf16,fp8-tensorwise,fp4,fp4-weights-only} --out "$OUT/fp4_step_350m.json" 2>&1 \
  | tee "$OUT/fp4_step_350m.txt" | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -14
