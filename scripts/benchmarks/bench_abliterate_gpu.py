#!/usr/bin/env python3
"""abliterate on a Qwen3-30B-A3B-shaped model (12 layers, 4-bit, bfloat16, as scripts/benchmarks/bench_gpu.py builds it;
vocabulary 2,048 so the bundled tokenizer can read its replies): 16 + 16 capture prompts of 2,048 tokens at --batch-size
4 (4 x 2,048 tokens a forward: 65,536 routed rows per MoE call at top-8), all writers of every layer, one round, random
weights so refusal_filter=False. Prints wall time and MLX peak memory. Meant for a GPU (docs/benchmarks/gpu.md).

    python -m scripts.benchmarks.bench_abliterate_gpu
"""
import json, time, tempfile
from pathlib import Path
import mlx.core as mx
from mlx_fun import jobs
from mlx_fun.rewrite.abliterate_options import Estimate, Evaluation, Projection
from scripts.lib.models import gpu_shape, save_with_bundled_tokenizer
from scripts.lib.paths import CALIBRATION
tmp = Path(tempfile.mkdtemp())
t0 = time.perf_counter()
model, config, _ = gpu_shape(layers=12, vocab=2048)
out = save_with_bundled_tokenizer(model, config, tmp / "m")
del model; mx.clear_cache()
print(f"built and saved in {time.perf_counter() - t0:.1f} s", flush=True)
rows = [json.loads(l) for l in open(CALIBRATION)]
text = " ".join(r["content"] for r in rows if isinstance(r.get("content"), str)) * 40
for name, k in (("h", 0), ("b", 1)):
    with open(tmp / f"{name}.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"content": text[(i * 997 + k * 4999) % 20000:][:60000]}) + "\n")
mx.reset_peak_memory()
t0 = time.perf_counter()
r = jobs.abliterate.run(model=out, harmful_dataset=tmp / "h.jsonl", benign_dataset=tmp / "b.jsonl", output=tmp / "abl",
                        max_samples=16, max_tokens=2048, batch_size=4, seed=0,
                        estimate=Estimate(rounds=1, refusal_filter=False), projection=Projection(layers="all"),
                        evaluation=Evaluation(eval_samples=4, reply_tokens=4))
wall = time.perf_counter() - t0
print(f"abliterate 12-layer Qwen3-30B-A3B shape 4-bit bf16: capture 16+16 prompts x 2048 tokens at batch 4 "
      f"(4 x 2048 tokens a forward), all writers of {len(r.layers)} layers: wall {wall:.1f} s, "
      f"peak memory {mx.get_peak_memory() / 2**30:.2f} GiB, modified {sum(len(v) for v in r.modified.values())} writers",
      flush=True)
