"""Where things are: the repository root and what ships under data/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the bundled base model and its chat fine-tune, the safety prompt sets, the bundled calibration text
BUNDLED = ROOT / "data" / "tiny-moe"
CHAT = ROOT / "data" / "tiny-moe-chat"
SAFETY = ROOT / "data" / "safety"
CALIBRATION = ROOT / "data" / "calibration_sample.jsonl"
#: the benchmark reports the scripts regenerate
REPORTS = ROOT / "docs" / "benchmarks"
