"""Shared fixtures: tiny random MoE models of every supported family, built offline once per session."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import signal  # noqa: E402

# A suite started in the background (`cmd &` in a script) inherits an ignored SIGINT, and so would every child it
# starts: Ctrl-C (which the tests send to real `mlx-fun` runs) would do nothing there. Children get it as a
# terminal gives it, however the suite was started.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402

from mlx_fun.adapters import ALIASES, supported_model_types  # noqa: E402

#: every supported model type with its own tiny config (mlx-lm's aliases build the same classes as their target)
FAMILIES = [t for t in supported_model_types() if t not in ALIASES]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    from mlx_fun.testing.tiny import train_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def make_model(tmp_path_factory, tokenizer_dir):
    """``make_model(model_type, bits=None, mode='affine', **overrides) -> Path``, cached per arguments."""
    from mlx_fun.testing.tiny import make_tiny_model

    cache: dict = {}
    root = tmp_path_factory.mktemp("models")

    def factory(model_type: str, bits: int | None = None, mode: str = "affine", **overrides):
        key = (model_type, bits, mode, repr(sorted(overrides.items())))
        if key not in cache:
            name = f"{model_type}-{bits or 'f'}-{mode}-{len(cache)}"
            cache[key] = make_tiny_model(
                model_type, root / name, bits=bits, mode=mode, tokenizer_dir=tokenizer_dir, **overrides
            )
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def qwen_model(make_model):
    """A tiny float qwen3_moe directory (the default family for pipeline tests)."""
    return make_model("qwen3_moe")


@pytest.fixture(autouse=True)
def _no_environment_leaks():
    """A test must not leave MLX_FUN_* / LD_PRELOAD changes behind: a leaked MLX_FUN_BLAS_REEXEC silently put every
    later subprocess on the slow reference BLAS."""
    watched = lambda: {k: v for k, v in os.environ.items() if k.startswith("MLX_FUN_") or k == "LD_PRELOAD"}  # noqa: E731
    before = watched()
    yield
    assert watched() == before, "this test changed MLX_FUN_* / LD_PRELOAD in os.environ without restoring it"
