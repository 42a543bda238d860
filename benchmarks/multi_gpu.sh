#!/usr/bin/env bash
# lowbit's distributed training on 2 GPUs with NCCL, in parts of up to about 10 minutes each.
#   bash benchmarks/multi_gpu.sh a   1b: one-GPU reference, dp2 gradient exchange bf16/fp8/fp32, dp2 vs tp2 vs
#                                    tp2+sp under fp8-tensorwise, pp2 1F1B with per-stage compute timed alone
#   bash benchmarks/multi_gpu.sh b   125m: context parallel ring vs rsa (32k, longer while it fits), a 300-step
#                                    tp2+sp fp8 run and a dp2 zero1 fp8-exchange run against the one-GPU run
#   bash benchmarks/multi_gpu.sh c   follow-ups: tp2 bf16, the one-GPU fp8-tensorwise 1b reference, a ZeRO-1 run
#                                    that writes its checkpoint, GPipe
#   bash benchmarks/multi_gpu.sh d   the rewritten gradient exchange in training (dp2 bf16/fp8), FSDP2 dp_shard2
#                                    bf16 and fp8-tensorwise (one writes its DCP checkpoint)
#   bash benchmarks/multi_gpu.sh e   FSDP2 fp8-tensorwise: weights all-gathered as FP8 vs fp32; a 125m run with its checkpoint
#   bash benchmarks/multi_gpu.sh f   125m context parallel: zigzag vs plain split at 32k (ring, rsa), then the longest
#                                    trainable sequence (64k, 128k) of each; ~235 s (TIME_S 225 by default)
# Env: SRC (lowbit sources, default this repository's src), DATA (a prepared dataset dir; empty: the built-in
# corpus, too small for the long-sequence parts), OUT (results), TIME_S (seconds this part may take), SMOKE=1 (CPU, gloo, tiny shapes: checks the script itself).
# Each sub-run's summary is appended to $OUT/results.jsonl as soon as it ends (multi_gpu_report.py collect).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
HERE=$(cd "$(dirname "$0")" && pwd)
SRC=${SRC:-$(cd "$HERE/.." && pwd)/src}
export PYTHONPATH=$SRC
DATA=${DATA:-}
OUT=${OUT:-out}; mkdir -p "$OUT"
WORK=${WORK:-/tmp/lowbit_multi_gpu}; rm -rf "$WORK"; mkdir -p "$WORK"
DEFAULT_TIME_S=560; [ "${1:-a}" = f ] && DEFAULT_TIME_S=225
TIME_S=${TIME_S:-$DEFAULT_TIME_S}
PY=${PY:-python3}
T0=$(date +%s)
PORT=29511
COMMON=(--data.path="$DATA" --checkpoint.every=0 --train.eval_every=0 --train.eval_batches=1 --train.log_every=1
        --numerics.telemetry_every=0 --run.plot=false --parallel.timeout_s=120)
SMOKE_ARGS=()
if [ "${SMOKE:-0}" = 1 ]; then
  SMOKE_ARGS=(--model.preset=tiny --model.tie_embeddings=false --run.device=cpu --train.batch_size=8 --train.steps=4 --data.seq_len=64)
fi

left() { echo $(( TIME_S - ($(date +%s) - T0) )); }

# sub NAME TIMEOUT NPROC [ENV=VALUE ...] -- ARGS...   (skipped when the part's time left is short of TIMEOUT/2)
sub() {
  local name=$1 t=$2 np=$3; shift 3
  local envs=()
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  local l; l=$(left)
  if [ "$l" -lt $(( t / 2 )) ]; then echo "== $name: skipped ($l s left)"; echo "{\"name\": \"$name\", \"rc\": -1, \"skipped\": \"time\", \"steps_done\": 0, \"loss\": [], \"ranks\": []}" >> "$OUT/results.jsonl"; return; fi
  [ "$t" -gt "$l" ] && t=$l
  local dir=$WORK/$name launch
  PORT=$((PORT + 1))
  if [ "$np" = 1 ]; then launch=($PY "$HERE/multi_gpu_report.py" train)
  else launch=($PY -m torch.distributed.run --nproc-per-node "$np" --master-addr 127.0.0.1 --master-port $PORT "$HERE/multi_gpu_report.py" train); fi
  local s0; s0=$(date +%s)
  env "${envs[@]}" timeout -k 5 "$t" "${launch[@]}" --run.dir="$dir" "${COMMON[@]}" "$@" "${SMOKE_ARGS[@]}" \
    > "$WORK/$name.log" 2>&1
  local rc=$?
  $PY "$HERE/multi_gpu_report.py" collect "$name" "$dir" "$rc" "$WORK/$name.log" >> "$OUT/results.jsonl"
  { echo "==== $name rc=$rc $(( $(date +%s) - s0 ))s"; grep -v -E "^(W|I)[0-9]{4}|FutureWarning|warnings.warn" "$WORK/$name.log" | tail -25; } >> "$OUT/logs.txt"
  echo "== $name rc=$rc $(( $(date +%s) - s0 ))s: $(grep -E '^step' "$WORK/$name.log" | tail -1)"
  (cd "$WORK" && tar -czf "$OUT/runs.tgz" --exclude='*.pt' --exclude='*.safetensors' --exclude='ckpt*' --exclude='step_*' */metrics.jsonl */bench_rank*.json */memory.json */config.toml */summary.json 2>/dev/null)
}

peak_of() {  # max peak GiB over ranks of a collected run (0 if none)
  $PY - "$OUT/results.jsonl" "$1" <<'EOF'
import json, sys
runs = {}
for l in open(sys.argv[1]):
    r = json.loads(l); runs[r["name"]] = r
r = runs.get(sys.argv[2], {})
ok = r.get("rc") == 0
print(int(max([x.get("peak_mem_gib") or 0 for x in r.get("ranks", [])], default=0)) + 1 if ok else 999)
EOF
}

steps_of() {  # training steps a collected run finished (0 if none): did it fit in memory at all?
  $PY -c "import json, sys; r = {}
for l in open(sys.argv[1]): x = json.loads(l); r[x['name']] = x
print(r.get(sys.argv[2], {}).get('steps_done', 0))" "$OUT/results.jsonl" "$1"
}

{ date -u; nvidia-smi -L; nvidia-smi topo -m; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else '')"; env | grep -E "NVLS|MULTICAST"; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

B1=(--model.preset=1b --data.seq_len=2048 --train.batch_size=16)
case "${1:-a}" in
  a)
    # data-parallel gradient exchange, bf16 recipe, 20 steps, same global batch as one GPU (micro 8 = dp2's share)
    sub ref1_1b_bf16 110 1 -- "${B1[@]}" --train.steps=20 --train.micro_batch_size=8
    sub dp2_1b_bf16sync 90 2 -- "${B1[@]}" --train.steps=20 --parallel.dp=2 --parallel.grad_sync=bf16
    sub dp2_1b_fp8sync 90 2 -- "${B1[@]}" --train.steps=20 --parallel.dp=2 --parallel.grad_sync=fp8
    # fp8-tensorwise: data parallel only vs tensor parallel vs tensor + sequence parallel
    sub dp2_1b_fp8tw 80 2 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.dp=2 --parallel.grad_sync=bf16
    sub tp2_1b_fp8tw 80 2 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.tp=2
    sub tp2sp_1b_fp8tw 80 2 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.tp=2 --parallel.sequence_parallel=true
    # pipeline: 2 stages, 1F1B over 8 micro-batches of 2; then each stage's compute alone
    sub pp2_1b_1f1b_m8 100 2 BENCH_BUBBLE=1 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --parallel.pp=2 --parallel.pp_schedule=1f1b --train.micro_batch_size=2
    sub dp2_1b_fp32sync 90 2 -- "${B1[@]}" --train.steps=20 --parallel.dp=2 --parallel.grad_sync=fp32
    sub dp2_1b_fp8tw_fp8sync 80 2 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.dp=2 --parallel.grad_sync=fp8
    sub pp2_1b_gpipe_m8 100 2 BENCH_BUBBLE=1 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --parallel.pp=2 --parallel.pp_schedule=gpipe --train.micro_batch_size=2
    ;;
  b)
    C=(--model.preset=125m --train.batch_size=1 --train.steps=5)
    sub ref1_125m_32k 90 1 BENCH_NO_CKPT=1 -- "${C[@]}" --data.seq_len=32768
    sub cp2_ring_32k 120 2 BENCH_NO_CKPT=1 -- "${C[@]}" --data.seq_len=32768 --parallel.cp=2 --parallel.cp_impl=ring
    sub cp2_rsa_32k 120 2 BENCH_NO_CKPT=1 -- "${C[@]}" --data.seq_len=32768 --parallel.cp=2 --parallel.cp_impl=rsa
    if [ "$(peak_of cp2_rsa_32k)" = 999 ]; then  # rsa keeps Lq x L probabilities per layer: recompute them
      sub cp2_rsa_32k_ckpt 120 2 BENCH_NO_CKPT=1 -- "${C[@]}" --data.seq_len=32768 --parallel.cp=2 --parallel.cp_impl=rsa --model.checkpointing=full
    fi
    # a few hundred steps on 2 GPUs against one GPU (checkpoints written at the end, under NCCL)
    L=(--model.preset=125m --data.seq_len=512 --train.batch_size=16 --train.steps=300 --recipe=fp8-tensorwise)
    sub ref1_125m_fp8tw_300 110 1 -- "${L[@]}"
    sub tp2sp_125m_fp8tw_300 110 2 -- "${L[@]}" --parallel.tp=2 --parallel.sequence_parallel=true
    # longest sequence: one longer try each, chosen from the 32k (rsa: 16k) peak, attention memory ~ L^2
    probe() {  # IMPL BASE_NAME BASE_LEN
      local p; p=$(peak_of $2)
      [ "$p" = 999 ] && return
      for len in 131072 98304 65536 49152 40960; do
        if [ $(( p * len * len / ($3 * $3) )) -lt 125 ] && [ "$len" -gt "$3" ]; then
          sub cp2_$1_$((len / 1024))k 170 2 BENCH_NO_CKPT=1 -- "${C[@]}" --data.seq_len=$len --parallel.cp=2 --parallel.cp_impl=$1
          return
        fi
      done
    }
    probe ring cp2_ring_32k 32768
    if [ "$(peak_of cp2_rsa_32k)" = 999 ]; then
      sub cp2_rsa_16k 90 2 BENCH_NO_CKPT=1 -- "${C[@]}" --data.seq_len=16384 --parallel.cp=2 --parallel.cp_impl=rsa
      probe rsa cp2_rsa_16k 16384
    else
      probe rsa cp2_rsa_32k 32768
    fi
    sub dp2z1_125m_fp8tw_fp8sync_300 110 2 -- "${L[@]}" --parallel.dp=2 --parallel.zero=1 --parallel.grad_sync=fp8
    ;;
  c)
    # follow-ups: tp2 under bf16 (against ref1_1b_bf16 of part a), the one-GPU fp8-tensorwise 1b reference for
    # the tp/dp fp8 runs, a ZeRO-1 run whose end-of-run checkpoint is written under NCCL, GPipe beside 1F1B
    sub tp2_1b_bf16 50 2 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --parallel.tp=2
    sub ref1_1b_fp8tw 55 1 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --train.micro_batch_size=8
    sub dp2z1_125m_ckpt 45 2 -- --model.preset=125m --data.seq_len=512 --train.batch_size=16 --train.steps=20 --recipe=fp8-tensorwise --parallel.dp=2 --parallel.zero=1 --parallel.grad_sync=fp8
    sub pp2_1b_gpipe_m8 50 2 BENCH_BUBBLE=1 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --parallel.pp=2 --parallel.pp_schedule=gpipe --train.micro_batch_size=2
    ;;
  d)
    # the rewritten gradient exchange inside training (against part a's dp2 runs), and FSDP2
    # (parallel.dp_shard) against the one-GPU and dp2 runs of part a; one FSDP run writes its DCP checkpoint
    sub dp2_1b_bf16sync_v2 90 2 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=20 --parallel.dp=2 --parallel.grad_sync=bf16
    sub dp2_1b_fp8sync_v2 90 2 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=20 --parallel.dp=2 --parallel.grad_sync=fp8
    sub fsdp2_1b_bf16 120 2 -- "${B1[@]}" --train.steps=20 --parallel.dp_shard=2 --parallel.grad_sync=bf16
    sub fsdp2_1b_fp8tw 80 2 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.dp_shard=2 --parallel.grad_sync=bf16
    ;;
  e)
    # FSDP2 fp8-tensorwise with the weights all-gathered as FP8 bytes (default) against fp32 all-gathers
    sub fsdp2_1b_fp8tw_fp8gather 90 2 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.dp_shard=2 --parallel.grad_sync=bf16
    sub fsdp2_1b_fp8tw_fp32gather 90 2 BENCH_NO_CKPT=1 -- "${B1[@]}" --train.steps=10 --recipe=fp8-tensorwise --parallel.dp_shard=2 --parallel.grad_sync=bf16 --parallel.fsdp_fp8_gather=false
    sub fsdp2_125m_fp8tw_fp8gather_ckpt 60 2 -- --model.preset=125m --data.seq_len=512 --train.batch_size=16 --train.steps=20 --recipe=fp8-tensorwise --parallel.dp_shard=2
    ;;
  f)
    # parallel.cp_layout at 32k: zigzag (balanced causal work) vs plain (rank 1 computes 2 blocks, rank 0 one: its
    # other block is fully masked and skipped); 4 steps, steps 3-4 timed. rsa needs full checkpointing at 32k
    # (part b: it keeps its Lq x L probabilities per layer). Then the longest trainable sequence, full
    # checkpointing, 3 steps: 64k, and 128k only if 64k trained a step; an OOM is recorded and ends that search.
    # Sub-runs that no longer fit in TIME_S are skipped (recorded), so the part ends in time.
    C=(--model.preset=125m --train.batch_size=1 --parallel.cp=2)
    for layout in zigzag plain; do
      sub cp2f_ring_32k_$layout 75 2 BENCH_NO_CKPT=1 -- "${C[@]}" --train.steps=4 --data.seq_len=32768 --parallel.cp_impl=ring --parallel.cp_layout=$layout
    done
    for impl in ring rsa; do
      for len in 65536 131072; do
        sub cp2f_${impl}_$((len / 1024))k_ckpt 90 2 BENCH_NO_CKPT=1 -- "${C[@]}" --train.steps=3 --data.seq_len=$len --parallel.cp_impl=$impl --model.checkpointing=full
        [ "$(steps_of cp2f_${impl}_$((len / 1024))k_ckpt)" -gt 0 ] || break
      done
    done
    for layout in zigzag plain; do
      sub cp2f_rsa_32k_${layout}_ckpt 75 2 BENCH_NO_CKPT=1 -- "${C[@]}" --train.steps=4 --data.seq_len=32768 --parallel.cp_impl=rsa --parallel.cp_layout=$layout --model.checkpointing=full
    done
    # with time left and 64k out of memory: ring between part b's 40k and 64k
    [ "$(steps_of cp2f_ring_64k_ckpt)" = 0 ] && sub cp2f_ring_48k_ckpt 70 2 BENCH_NO_CKPT=1 -- "${C[@]}" --train.steps=3 --data.seq_len=49152 --parallel.cp_impl=ring --model.checkpointing=full
    $PY "$HERE/multi_gpu_report.py" cp "$OUT/results.jsonl" | tee "$OUT/cp_table.md"
    ;;
esac
$PY "$HERE/multi_gpu_report.py" report "$OUT/results.jsonl" | tee "$OUT/table.md"
echo "part ${1:-a} done in $(( $(date +%s) - T0 ))s"
