#!/usr/bin/env bash
# The convergence study of docs/convergence.md: a ~97M-parameter LLaMA (the 125m preset's 12 x 768 with an
# 8192-token BPE) trained on 50.3M tokens of Python sources (this machine's site-packages) under each recipe, several
# runs per GPU at once through `lowbit compare --devices`.
#   SRC=src RECIPES=a,b,c DEVICES=cuda:0,cuda:0,cuda:0 [PRIOR=dir] bash benchmarks/convergence_study.sh
# RECIPES: compare's --recipes entries, RECIPE or RECIPE+section.key=value (default: the six below). DEVICES: compare's
# --devices, one slot per concurrent run. SEEDS: compare's --seeds (optional). COMPILE=true: torch.compile every run
# (default eager); COMPILE_SCOPE: train.compile_scope (default model, as the first two series ran; blocks compiles
# one block for all, in a fraction of the time). MICRO: micro-batch size (default 32; 64 = one micro-batch per step).
# STEPS: training steps (default 768). PRIOR: a folder of finished run dirs (metrics, config, summary) copied in
# first, so that compare skips them and reports them beside the new ones. TOKENIZER: a tokenizer.json; without it (or
# when its file is missing) an 8192-token BPE is trained on the next 45 MB of the same walk (disjoint from the corpus)
# and written to $OUT/tokenizer.json: keep it, so that later runs can join the same series. CACHE: see below.
# DEADLINE: a wall-clock limit in seconds from the script's start (default 555); runs still going then get SIGTERM
# (each checkpoints and stops; run the same command again on the same machine to resume them). What came out is packed
# into $OUT/study.tar.gz (metrics, telemetry, logs, report; no checkpoints); the run dirs stay in /tmp/study/runs.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${SRC:-src}
TOKENIZER=${TOKENIZER:-}
DEADLINE=${DEADLINE:-555}
OUT=${OUT:-/tmp/study-out}
W=/tmp/study
T0=$(date +%s)
mkdir -p "$W" "$OUT"
# Compiling an FP8 run took ~3 min with 3 at once. CACHE (a tar.gz from an earlier run's $OUT/inductor.tar.gz)
# restores inductor's and Triton's caches, so only tracing is paid again; the caches are written to $OUT when the
# archive is under 16 MB.
export TORCHINDUCTOR_CACHE_DIR=$W/inductor TRITON_CACHE_DIR=$W/inductor/triton
if [ -n "${CACHE:-}" ] && [ -f "$CACHE" ] && [ ! -d "$W/inductor" ]; then tar -xzf "$CACHE" -C "$W"; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'

# 1. The corpus: .py files under 400 kB from site-packages, walked in path order, until 230 MB; the next 45 MB of
#    the walk are the tokenizer's training sample.
[ -f "$W/data/meta.json" ] || python3 - "$W/src" "$W/toksample" <<'PY'
import os, shutil, site, sys
root, dst, sample = site.getsitepackages()[0], sys.argv[1], sys.argv[2]
sizes = {"corpus": [0, 0], "sample": [0, 0]}
for d, dirs, files in os.walk(root):
    dirs.sort()
    for f in sorted(files):
        p = os.path.join(d, f)
        if not (f.endswith(".py") and os.path.getsize(p) < 400_000):
            continue
        which = "corpus" if sizes["corpus"][0] < 230e6 else "sample" if sizes["sample"][0] < 45e6 else None
        if which:
            to = os.path.join(dst if which == "corpus" else sample, os.path.relpath(p, root))
            os.makedirs(os.path.dirname(to), exist_ok=True)
            shutil.copyfile(p, to)
            sizes[which][0] += os.path.getsize(p)
            sizes[which][1] += 1
for k, (b, n) in sizes.items():
    print(f"{k}: {n} files, {b / 1e6:.0f} MB from {root}")
PY
# lowbit prepare refuses a file with many undecodable bytes (one in the walk, joblib's
# test_func_inspect_special_encoding.py); the study's corpus read it with them replaced, so it is written that way
[ -f "$W/data/meta.json" ] || python3 - "$W/src" <<'PY'
import pathlib, sys
for p in pathlib.Path(sys.argv[1]).rglob("*.py"):
    b = p.read_bytes()
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        p.write_text(b.decode("utf-8", errors="replace"), encoding="utf-8")
        print(f"re-encoded {p} as its replacement characters decode")
PY
if [ -n "$TOKENIZER" ] && [ ! -f "$TOKENIZER" ]; then echo "TOKENIZER=$TOKENIZER is not a file"; exit 1; fi
if [ -z "$TOKENIZER" ]; then
    TOKENIZER=$W/tokenizer.json
    [ -f "$TOKENIZER" ] || python3 - "$W/toksample" "$TOKENIZER" <<'PY' || exit 1
import sys
from lowbit.data.documents import read_documents
from lowbit.data.tokenizer import train_tokenizer
train_tokenizer(read_documents([sys.argv[1]]), 8192).save(sys.argv[2])
PY
    cp "$TOKENIZER" "$OUT/tokenizer.json"
fi
# data left in /tmp/study by an earlier run of the script must come from this tokenizer
python3 -c "import json, os, sys; from lowbit.data.tokenizer import load_tokenizer, tokenizer_hash as h
t = h(load_tokenizer(sys.argv[1])); print('tokenizer', sys.argv[1], t)
m = os.path.join(sys.argv[2], 'meta.json')
sys.exit(os.path.exists(m) and json.load(open(m))['tokenizer_hash'] != t and f'{m}: another tokenizer')" \
    "$TOKENIZER" "$W/data" || exit 1
[ -f "$W/data/meta.json" ] || python3 -m lowbit prepare "$W/src" --tokenizer "$TOKENIZER" --out "$W/data" \
    --val-fraction 0.01 || exit 1
echo "prepared at $(( $(date +%s) - T0 )) s"

# 2. The runs: STEPS (default 768) x 64 x 1024 tokens = 50.3M tokens each; warm-up and validation every STEPS/12.
STEPS=${STEPS:-768}
RECIPES=${RECIPES:-bf16,fp4,fp8-tensorwise,fp8lm-o2,fp8-delayed,nanotron-r2}
DEVICES=${DEVICES:-cuda:0,cuda:1,cuda:0,cuda:1,cuda:0,cuda:1}
if [ -n "${PRIOR:-}" ]; then mkdir -p "$W/runs" && cp -rn "$PRIOR"/* "$W/runs/"; fi
ARGS=(--model.preset=125m --model.vocab_size=8192 --data.path="$W/data" --data.seq_len=1024 --train.steps="$STEPS" --train.batch_size=64
      --train.micro_batch_size="${MICRO:-32}" --train.lr=6e-4 --train.warmup_steps=$((STEPS / 12)) --train.eval_every=$((STEPS / 12))
      --train.eval_batches=8 --train.log_every=16 --numerics.telemetry_every=64 --run.plot=false
      --train.compile="${COMPILE:-false}" --train.compile_scope="${COMPILE_SCOPE:-model}")
LEFT=$(( DEADLINE - ($(date +%s) - T0) ))
[ "$LEFT" -gt 60 ] || { echo "no time left for training after preparing the data ($LEFT s)"; exit 1; }
SEED_ARGS=(${SEEDS:+--seeds "$SEEDS"})  # SEEDS=0,1,2: every recipe once per seed (run dirs RECIPE+train.seed=S)
echo "COMMAND: lowbit compare --recipes $RECIPES ${SEED_ARGS[*]} --devices $DEVICES --out runs/study ${ARGS[*]}"
timeout -s TERM -k 60 "$LEFT" python3 -m lowbit compare --recipes "$RECIPES" "${SEED_ARGS[@]}" --devices "$DEVICES" \
    --out "$W/runs" "${ARGS[@]}"
echo "compare exit $? at $(( $(date +%s) - T0 )) s"
for f in "$W"/runs/*.log; do echo "== $(basename "$f" .log)"; tail -n 3 "$f"; done
tar -czf "$OUT/study.tar.gz" -C "$W" --exclude=checkpoints runs data/meta.json
tar -czf "$W/inductor.tar.gz" -C "$W" inductor 2>/dev/null && echo "inductor cache: $(du -h "$W/inductor.tar.gz" | cut -f1)"
[ "$(stat -c %s "$W/inductor.tar.gz" 2>/dev/null || echo 999999999)" -lt 16000000 ] && mv "$W/inductor.tar.gz" "$OUT/"
ls -la "$OUT"
