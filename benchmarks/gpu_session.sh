#!/usr/bin/env bash
# One device call: install lowbit on the GPU machine, run the whole test suite there (GPU tests included),
# the default training job on the GPU, and the 1b step benchmark. Output lands in $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv
timeout 240 python3 -m pytest -q -x -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -5
timeout 200 python3 -m lowbit train --run.dir /tmp/gpu-run --train.steps 250 2>&1 | tee "$OUT/train_gpu.txt" | tail -8
timeout 400 python3 benchmarks/step_1b.py --steps 10 --out "$OUT/step_1b.json" 2>&1 | tee "$OUT/step_1b.txt" \
  | grep -v -E "^(W|I)[0-9]{4}" | tail -20
