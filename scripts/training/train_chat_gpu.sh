#!/usr/bin/env bash
# The bundled chat model alone, fine-tuned from a kept base on one lent GPU machine (MLX CUDA), several runs at
# once, in the background (the base stays as it is: scripts/training/train_pair_gpu.sh makes both):
#
#   RUNS="a:2e-4:0.6:3:32:3200 b:1e-4:0.6:3:32:4000" \
#     setsid nohup bash scripts/training/train_chat_gpu.sh [BASE] [CHAT_MINUTES] [OUT_DIR] &
#     # defaults: data/tiny-moe, 4, /tmp/chat
#
# RUNS: one NAME:LR:HARMFUL_WEIGHT:LOOKALIKE_WEIGHT:BATCH:STEPS[:SEED] per run (scripts/training/train_chat_moe.py's
# options; each keeps its best checkpoint on data/safety's validation items). The kept run is the best validation
# score (harmful refusal - the larger benign refusal): OUT_DIR/pick.log. Every run's refusal rates on the validation
# and test sets (scripts/benchmarks/bench_refusal.py) are measured after training, and only reported.
# OUT_DIR/return: the kept run in float32 shards of at most 14 MB and every run's logs (what a lent machine returns).
# OUT_DIR/STAGE names the step running; OUT_DIR/DONE marks the end.
set -u
cd "$(dirname "$0")/../.."
BASE=${1:-data/tiny-moe}
CMIN=${2:-4}
OUT=${3:-/tmp/chat}
RUNS=${RUNS:-"a:2e-4:0.6:3:32:3200"}
mkdir -p "$OUT/return"
{ date; nproc; python -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"; } > "$OUT/host.log" 2>&1
echo chat > "$OUT/STAGE"
for run in $RUNS; do
  IFS=: read -r name lr hw lw bs steps seed <<< "$run"
  python -m scripts.training.train_chat_moe --init "$BASE" --data data/safety --output "$OUT/chat-$name" \
    --minutes "$CMIN" --steps "$steps" --eval-every 200 --lr "$lr" --harmful-weight "$hw" --lookalike-weight "$lw" \
    --batch-size "$bs" --seed "${seed:-0}" > "$OUT/chat-$name.log" 2>&1 &
done
wait
echo refusal > "$OUT/STAGE"
for d in "$OUT"/chat-*/; do
  python -m scripts.benchmarks.bench_refusal --model "$d" data/safety/chat_valid_*.jsonl data/safety/*_test.jsonl \
    > "$OUT/$(basename "$d").refusal.log" 2>&1 &
done
wait
KEPT=$(python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

from scripts.lib.chat import score  # the fine-tune's own checkpoint score

logs = {p.parent: json.loads(p.read_text())["validation"] for p in Path(sys.argv[1]).glob("chat-*/training_log.json")}
for d, rates in sorted(logs.items()):
    print(d.name, round(score(rates), 3), file=sys.stderr)
print(max(logs, key=lambda d: score(logs[d])))
EOF
)
echo "kept $KEPT" >> "$OUT/pick.log"
echo return > "$OUT/STAGE"
python -m scripts.tools.shard_model "$KEPT" "$OUT/return/chat" --max-mb 14 >> "$OUT/pick.log" 2>&1
(cd "$OUT" && tar czf return/logs.tgz ./*.log chat-*/*.json chat-*/README.md)
date >> "$OUT/pick.log"
touch "$OUT/DONE"
