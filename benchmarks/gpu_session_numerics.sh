#!/usr/bin/env bash
# One device call for the numerics core: torchao from the carried wheel, the LLaMA-7B MLP benchmark (bf16 vs
# lowbit vs torchao) and the quantization timing, the numerics tests on the GPU, and `lowbit train --recipe`
# compiled on the GPU. Output in $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2
python3 -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__, torch.cuda.get_device_name())"
timeout 300 python3 benchmarks/mlp_7b.py --out "$OUT/mlp_7b.json" 2>&1 | tee "$OUT/mlp_7b.txt" | grep -v -E "^[WIE][0-9]{4}" | tail -14
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_linear.py tests/test_scaling.py tests/test_formats.py tests/test_gpu.py -k "not within and not inspect" 2>&1 | tee "$OUT/pytest_gpu.txt" | tail -4
for r in fp8-tensorwise fp8-delayed; do
  timeout 120 python3 -m lowbit train --recipe $r --train.compile true --train.steps 100 --train.log_every 50 --run.dir /tmp/gpu-$r 2>&1 | grep -v -E "^[WIE][0-9]{4}" | tail -3
done 2>&1 | tee "$OUT/train_recipes_gpu.txt"
