"""What the jobs share (mlx_fun/jobs/common.py): a model is checked once, before loading, and not again."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from mlx_fun import adapters, jobs
from mlx_fun.model import io

DATASET = Path(__file__).resolve().parent.parent / "data" / "calibration_sample.jsonl"


def _count_calls(monkeypatch, module, name: str, calls: Counter) -> None:
    """Count the calls of the real ``module.name`` (it still runs)."""
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_collect_checks_the_model_once(qwen_model, tmp_path, monkeypatch):
    """One config read, one tokenizer check and one adapter-class resolution per collect (they used to run twice
    and three times: the job's check, again in load_moe, again for the token budget)."""
    calls = Counter()
    for module, name in ((adapters, "adapter_class"), (io, "read_config"), (io, "check_tokenizer")):
        _count_calls(monkeypatch, module, name, calls)
    result = jobs.collect.run(model=qwen_model, dataset=DATASET, output=tmp_path / "s.npz", max_samples=2,
                              max_tokens=16)
    assert (tmp_path / "s.npz").is_file() and result.tokens > 0
    assert calls == {"adapter_class": 1, "read_config": 1, "check_tokenizer": 1}
