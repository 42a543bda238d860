#!/usr/bin/env bash
# FP8-LM at the scale it exists for, on one GPU: the optimizer step alone per recipe (`bench optim`, 1b and 7b),
# the 7b training step at 4 x 2048 beside bf16 and torchao, the largest micro-batch per recipe at 7b
# (`bench step --max-batch`), and a 13b model trained under fp8lm-o2. Each part has its own time limit and writes
# its JSON after every row, so a part cut short keeps what it measured. Output in $OUT (or ./out).
#
#   bash benchmarks/fp8lm_scale.sh check      # GPU tests of the optimizer, bench optim 7b, bench step 7b
#   bash benchmarks/fp8lm_scale.sh optim1b    # bench optim 1b, the compiled passes beside the Triton kernels
#   bash benchmarks/fp8lm_scale.sh 13b        # GPU tests of fp16 weights, 13b under fp8lm-o2 for 50 steps
#   bash benchmarks/fp8lm_scale.sh capacity   # bench step --max-batch at 7b: bf16, fp8lm-o2, torchao
#
# torchao comes from wheels in .whl/ when present; the 13b run reads a prepared dataset from $DATA (default
# data/stdlib-4k: `lowbit prepare <python sources> --out data/stdlib-4k --vocab-size 4096`), else the built-in
# corpus.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:src
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
part() {  # part NAME SECONDS ARGS...: lowbit bench ARGS --out $OUT/NAME.json, log in $OUT/NAME.txt
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m lowbit bench "$@" --out "$OUT/$name.json" 2>&1 | grep --line-buffered -v -E "^[WIE][0-9]{4}" \
    > "$OUT/$name.txt"
  echo "== $name (exit ${PIPESTATUS[0]})"; grep -v '^{' "$OUT/$name.txt" | tail -n 14
}
case "${1:-check}" in
  check)
    # pytest's output to a file, not a pipe: inductor's compile workers outlive it and would hold a pipe open
    timeout "${TESTS_S:-110}" python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -rf \
      -k "triton_update or optimizer_update or update_with_a_master" > "$OUT/pytest_gpu.txt" 2>&1
    tail -n 12 "$OUT/pytest_gpu.txt"
    part optim_7b "${OPTIM7_S:-200}" optim --preset 7b --steps 10 --warmup 3 --update both \
      --recipes fp8lm-o2,fp8lm-o3,fp4
    # the step with the Triton update (the default) where its test passed on this GPU, else the compiled passes
    grep -q " passed" "$OUT/pytest_gpu.txt" && ! grep -q -E "FAILED|ERROR| error" "$OUT/pytest_gpu.txt" \
      || { export LOWBIT_TRITON_UPDATE=0; echo "== the step with the compiled update (a GPU test failed)"; }
    part step_7b "${STEP_S:-250}" step --preset 7b --batch 4 --seq 2048 --steps 5 --warmup 2 \
      --recipes bf16,fp8-tensorwise,fp8lm-o2 --torchao tensorwise ;;
  optim1b)
    part optim_1b "${OPTIM1_S:-120}" optim --preset 1b --update both --recipes fp8lm-o2,nanotron-r2,fp4 \
      --steps 10 --warmup 3 ;;
  13b)
    timeout "${TESTS_S:-60}" python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu.py \
      -rf -k "fp16 or fp8lm_o2_trains" > "$OUT/pytest_gpu.txt" 2>&1
    tail -n 30 "$OUT/pytest_gpu.txt"
    data=${DATA:-data/stdlib-4k}; [ -d "$data" ] || data=""
    timeout "${TRAIN_S:-300}" python3 -m lowbit train --model.preset 13b --recipe fp8lm-o2 --data.path "$data" \
      --data.seq_len 2048 --train.batch_size 8 --train.micro_batch_size 4 --train.steps 50 --train.warmup_steps 10 \
      --train.lr 3e-4 --train.compile true --train.log_every 5 --train.eval_every 0 --train.eval_batches 1 \
      --numerics.telemetry_every 0 --checkpoint.save false --run.plot false --run.dir /tmp/run_13b 2>&1 \
      | grep --line-buffered -v -E "^[WIE][0-9]{4}" \
      | tee "$OUT/train_13b.txt" | tail -n 16
    cp /tmp/run_13b/metrics.jsonl "$OUT/train_13b_metrics.jsonl" 2>/dev/null ;;
  capacity)
    part capacity_7b "${CAP_S:-540}" step --preset 7b --seq 2048 --max-batch 32 --steps 3 --warmup 1 \
      --recipes bf16,fp8lm-o2 --torchao tensorwise ;;
  *) echo "unknown part $1 (check | optim1b | 13b | capacity)"; exit 2 ;;
esac
