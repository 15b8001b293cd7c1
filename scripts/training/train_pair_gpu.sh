#!/usr/bin/env bash
# The bundled base + chat pair (issue 33), end to end on one lent GPU machine (MLX CUDA), in the background:
#
#   RUNS="..." setsid nohup bash scripts/training/train_pair_gpu.sh [BASE_MINUTES] [CHAT_MINUTES] [OUT_DIR] &
#   # defaults: 10, 4, /tmp/pair
#
# 1. the corpus, from what the machine has installed (python -m scripts.tools.prepare_dataset --source all);
# 2. two base candidates at once, one per load-balancing weight in AUX_COEFS (default "0.01 0.03"), each by
#    scripts/training/train_base_gpu.sh (its SHAPE; training only: QUALITY=0; quality tables are measured on the
#    CPU);
# 3. the pick: the lowest validation loss among the candidates whose routing is not collapsed (busiest expert of
#    every layer at most 30x its least used on held-out text), else the least skewed one;
# 4. chat models fine-tuned from it on data/safety, one per recipe in RUNS, several at once
#    (scripts/training/train_chat_gpu.sh: each keeps its best checkpoint on the validation items, the best one is
#    kept, and every run's refusal rates on every test set are measured only);
# 5. OUT_DIR/return: the kept base and chat model in float16 shards of at most 14 MB, and the logs: what a lent
#    machine returns.
#
# OUT_DIR/STAGE names the step running; OUT_DIR/DONE marks the end. Each step logs under OUT_DIR.
set -u
cd "$(dirname "$0")/../.."
BMIN=${1:-10}
CMIN=${2:-4}
OUT=${3:-/tmp/pair}
mkdir -p "$OUT/return"
echo corpus > "$OUT/STAGE"
{ date; nproc; python -c "import mlx.core as mx; print(mx.__version__, mx.default_device())"; } > "$OUT/corpus.log" 2>&1
python -m scripts.tools.prepare_dataset --source all --max-package-bytes 2000000 --output "$OUT/corpus" \
  >> "$OUT/corpus.log" 2>&1
echo base > "$OUT/STAGE"
for aux in ${AUX_COEFS:-0.01 0.03}; do
  QUALITY=0 CORPUS="$OUT/corpus" AUX_COEF=$aux bash scripts/training/train_base_gpu.sh "$BMIN" "$OUT/base-$aux" &
done
wait
BASE=$(python - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

logs = {p.parent.parent: json.loads(p.read_text()) for p in Path(sys.argv[1]).glob("base-*/model/training_log.json")}
ok = {d: log for d, log in logs.items() if max(log["routing_max_min_ratio"]) <= 30}
pick = (min(ok, key=lambda d: sum(ok[d]["final_val_loss"].values())) if ok
        else min(logs, key=lambda d: max(logs[d]["routing_max_min_ratio"])))
print(pick / "model")
EOF
)
echo "picked $BASE" > "$OUT/pick.log"
echo chat > "$OUT/STAGE"
bash scripts/training/train_chat_gpu.sh "$BASE" "$CMIN" "$OUT/chat" > "$OUT/chat.log" 2>&1
echo return > "$OUT/STAGE"
python -m scripts.tools.shard_model "$BASE" "$OUT/return/base" --dtype float16 --max-mb 14 >> "$OUT/pick.log" 2>&1
KEPT=$(sed -n 's/^kept //p' "$OUT/chat/pick.log")
python -m scripts.tools.shard_model "$KEPT" "$OUT/return/chat" --dtype float16 --max-mb 14 >> "$OUT/pick.log" 2>&1
cp "$OUT/chat/return/logs.tgz" "$OUT/return/chat-logs.tgz"
(cd "$OUT" && tar czf return/logs.tgz --exclude='*.safetensors' --exclude=corpus/*/*.jsonl --exclude=return \
  --exclude=shards ./*.log base-*/*.log base-*/model/*.json base-*/model/README.md corpus/manifest.json)
date >> "$OUT/pick.log"
touch "$OUT/DONE"
