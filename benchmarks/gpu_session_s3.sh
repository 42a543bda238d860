#!/usr/bin/env bash
# Device calls of session 3. Part "a": performer vs flash (issue 6), then the 350m FP4 step (issue 5).
# Part "b": performer again (custom feature-map backward) with a profile, the 350m step without torch.compile
# (fp4's OCC layers are eager: compiling around ~170 of them took more than the call), GPU tests.
# Output lands in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
case "${1:-a}" in
  a)
    timeout 150 python3 benchmarks/performer.py --chunks 128,512 --out "$OUT/performer.json" 2>&1 \
      | tee "$OUT/performer.txt" | tail -9
    timeout 380 python3 benchmarks/optim_1b.py --preset 350m --no-optimizer-only --steps 10 \
      --recipes fp8-tensorwise,fp4,bf16,fp4-weights-only --out "$OUT/fp4_step_350m.json" 2>&1 \
      | tee "$OUT/fp4_step_350m.txt" | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -10 ;;
  b)
    timeout 120 python3 benchmarks/performer.py --chunks 256,1024 --profile 16384 --out "$OUT/performer.json" 2>&1 \
      | tee "$OUT/performer.txt" | tail -30
    timeout 200 python3 benchmarks/optim_1b.py --preset 350m --no-optimizer-only --steps 10 --eager \
      --recipes fp8-tensorwise,fp4,fp4-weights-only,bf16 --out "$OUT/fp4_step_350m_eager.json" 2>&1 \
      | tee "$OUT/fp4_step_350m_eager.txt" | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -10
    timeout 180 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k "tensor_cores or performer" \
      tests/test_performer.py 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -6 ;;
esac
if [ "${1:-a}" = c ]; then
  # Part "c": where fp4's step time goes (eager, 350m), beside fp8-tensorwise.
  timeout 240 python3 benchmarks/profile_step.py --preset 350m --recipes fp4,fp8-tensorwise,bf16 --rows 18 2>&1 \
    | grep -v -E "^(W|I)[0-9]{4}|warn" | tee "$OUT/profile_350m.txt" | tail -80
fi
if [ "${1:-a}" = d ]; then
  # Part "d": compiled 350m step for the recipes that compile whole (fp4-weights-only has no OCC).
  timeout 270 python3 benchmarks/optim_1b.py --preset 350m --no-optimizer-only --steps 10 \
    --recipes fp8-tensorwise,fp4-weights-only,bf16 --out "$OUT/fp4wo_step_350m.json" 2>&1 \
    | tee "$OUT/fp4wo_step_350m.txt" | grep -v -E "^(W|I)[0-9]{4}|warn" | tail -8
fi
