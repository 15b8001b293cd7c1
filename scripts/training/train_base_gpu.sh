#!/usr/bin/env bash
# The recipe of a bundled-base candidate, end to end on one GPU machine (MLX CUDA), as run for issue 33:
# corpus from what the machine has installed -> training -> REAP/frequency/random quality table -> shards
# (OUT_DIR/shards: files of at most 14 MB, what a lent machine can return; scripts/tools/shard_model.py).
#
#   bash scripts/training/train_base_gpu.sh [MINUTES] [OUT_DIR]      # defaults: 9 minutes, /tmp/base
#   CORPUS=/tmp/corpus AUX_COEF=0.01 bash scripts/training/train_base_gpu.sh 10 /tmp/base-a   # reuse a built corpus
#   (LR, AUX_COEF, Z_COEF: train_tiny_moe.py's --lr (default here 2e-3), --aux-coef, --z-coef)
#
# The shape is the bundled base's (issue 33, run 4): 5 layers, hidden 256, 64 experts of 32, top-8 (9.5M
# parameters), shipped in float16 (`mlx-fun quantize` starts from a float model; the CPU runs half-precision experts
# in float32) so that with its chat model at 6 bits both fit the 32 MB the repository allows. SHAPE overrides it
# (run 2's base: SHAPE="--layers 4 --experts 48 --top-k 6").
#
# QUALITY=0 skips the quality table (measured on the CPU instead). Every step logs under OUT_DIR (corpus.log,
# train.log, quality.log); OUT_DIR/DONE marks the end. On the lent GPU
# machines it runs in the background (setsid) so that a run can outlast one call. The corpus is whatever the
# machine has (its manifest names every package read); held-out splits are by document group (a package, a man
# page), so the quality rows score text of packages never trained on.
set -u
cd "$(dirname "$0")/../.."
MIN=${1:-9}
OUT=${2:-/tmp/base}
mkdir -p "$OUT"
{ date; nproc; python -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"; } > "$OUT/corpus.log" 2>&1
C=${CORPUS:-$OUT/corpus}
[ -f "$C/manifest.json" ] || python -m scripts.tools.prepare_dataset --source all --max-package-bytes 2000000 \
  --output "$C" >> "$OUT/corpus.log" 2>&1
D=code,prose,packages,packagedocs; W=2,4,1,2
[ -s "$C/manpages/train.jsonl" ] && D=$D,manpages && W=$W,1
[ -s "$C/debdocs/train.jsonl" ] && D=$D,debdocs && W=$W,1
echo "domains $D weights $W" >> "$OUT/corpus.log"
python -m scripts.training.train_tiny_moe --data "$C" --domains $D --weights $W --output "$OUT/model" \
  --tokenizer data/tiny-moe --hidden 256 --heads 4 --kv-heads 2 --moe-intermediate 32 \
  ${SHAPE:---layers 5 --experts 64 --top-k 8} --batch-size 64 --seq-len 512 --minutes "$MIN" --eval-every 500 \
  --eval-windows 64 --lr "${LR:-2e-3}" ${AUX_COEF:+--aux-coef $AUX_COEF} ${Z_COEF:+--z-coef $Z_COEF} \
  > "$OUT/train.log" 2>&1
[ "${QUALITY:-1}" = 0 ] || python -m scripts.benchmarks.bench_quality --model "$OUT/model" --data "$C" --no-quantize \
  --output "$OUT/quality.md" --json "$OUT/quality.json" --merge-group-sizes 16 > "$OUT/quality.log" 2>&1
python -m scripts.tools.shard_model "$OUT/model" "$OUT/shards" --max-mb 14 >> "$OUT/quality.log" 2>&1
date >> "$OUT/quality.log"
touch "$OUT/DONE"
