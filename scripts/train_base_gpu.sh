#!/usr/bin/env bash
# The recipe of a bundled-base candidate, end to end on one GPU machine (MLX CUDA), as run for issue 33:
# corpus from what the machine has installed -> training -> REAP/frequency/random quality table -> bfloat16 shards
# (OUT_DIR/shards: files of at most 14 MB, what a lent machine can return; scripts/shard_model.py).
#
#   bash scripts/train_base_gpu.sh [MINUTES] [OUT_DIR]      # defaults: 9 minutes, /tmp/base
#
# Every step logs under OUT_DIR (corpus.log, train.log, quality.log); OUT_DIR/DONE marks the end. On the lent GPU
# machines it runs in the background (setsid) so that a run can outlast one call. The corpus is whatever the
# machine has (its manifest names every package read); held-out splits are by document group (a package, a man
# page), so the quality rows score text of packages never trained on.
set -u
cd "$(dirname "$0")/.."
MIN=${1:-9}
OUT=${2:-/tmp/base}
mkdir -p "$OUT"
{ date; nproc; python -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"; } > "$OUT/corpus.log" 2>&1
python scripts/prepare_dataset.py --source all --max-package-bytes 2000000 --output "$OUT/corpus" \
  >> "$OUT/corpus.log" 2>&1
D=code,prose,packages,packagedocs; W=2,4,1,2
[ -s "$OUT/corpus/manpages/train.jsonl" ] && D=$D,manpages && W=$W,1
[ -s "$OUT/corpus/debdocs/train.jsonl" ] && D=$D,debdocs && W=$W,1
echo "domains $D weights $W" >> "$OUT/corpus.log"
python scripts/train_tiny_moe.py --data "$OUT/corpus" --domains $D --weights $W --output "$OUT/model" \
  --tokenizer data/tiny-moe --hidden 320 --layers 6 --heads 5 --kv-heads 1 --experts 64 --top-k 8 \
  --moe-intermediate 64 --batch-size 64 --seq-len 512 --minutes "$MIN" --eval-every 500 --eval-windows 64 \
  --lr 2e-3 ${AUX_COEF:+--aux-coef $AUX_COEF} > "$OUT/train.log" 2>&1
python scripts/bench_quality.py --model "$OUT/model" --data "$OUT/corpus" --no-quantize --output "$OUT/quality.md" \
  --json "$OUT/quality.json" --merge-group-sizes 16 > "$OUT/quality.log" 2>&1
python scripts/shard_model.py "$OUT/model" "$OUT/shards" --dtype bfloat16 --max-mb 14 >> "$OUT/quality.log" 2>&1
date >> "$OUT/quality.log"
touch "$OUT/DONE"
